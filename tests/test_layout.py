"""The package's layers keep their direction (docs/design.md, "Where things live"): read
from the source, every import of every module, also the ones inside functions."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mgrit"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved), and of
    every `torch.cuda` it touches as an attribute."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Attribute) and node.attr == "cuda"
              and isinstance(node.value, ast.Name) and node.value.id == "torch"):
            found.add("torch.cuda")
    return found


def _files(*parts: str) -> list[Path]:
    return sorted(PACKAGE.joinpath(*parts).rglob("*.py"))


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _offending(files: list[Path], forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()
               ) -> list[str]:
    """'FILE imports MODULE' for every import of a module in `forbidden` but not in
    `allowed`."""
    return [f"{path.relative_to(ROOT)} imports {module}" for path in files
            for module in sorted(_imports(path))
            if _within(module, forbidden) and not _within(module, allowed)]


def test_the_layout_is_there_and_every_package_says_what_it_is():
    packages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert packages == ["app", "comm", "core", "execute", "kernels", "nn", "problems"]
    for package in [PACKAGE, *(PACKAGE / p for p in packages), ROOT / "benchmarks"]:
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 8, f"{package} has no docstring saying what it is"


def test_the_core_knows_no_network_no_mpi_library_no_kernel_and_no_tool():
    assert _offending(_files("core"), ("mpi4py", "torch.cuda", "mgrit.nn", "mgrit.kernels",
                                       "mgrit.problems", "mgrit.app", "benchmarks")) == []


def test_every_core_module_stays_short():
    """The algorithm's modules stay readable side by side with docs/solver.md: a module that
    grows past the limit is split by job (storage, messages, phases, transfers, residuals)."""
    long = {path.name: n for path in _files("core")
            if (n := len(path.read_text().splitlines())) > 450}
    assert long == {}


def test_only_the_boundary_object_moves_point_to_point_messages_in_the_core():
    """A level's messages to its neighbour ranks are set up, posted and completed in
    `mgrit/core/boundary.py` alone; the cycle and the relaxations ask a level's boundary."""
    messages = tuple(f"mgrit.comm.{name}" for name in ("send_init", "recv_init", "Persistent",
                                                         "Request"))
    users = [path.name for path in _files("core")
             if any(_within(module, messages) for module in _imports(path))]
    assert users == ["boundary.py"]


def test_the_seams_below_the_core_stay_below_it():
    # comm and execute serve the core: neither imports it beyond the propagator contract,
    # nor anything above it
    above = ("mgrit.nn", "mgrit.kernels", "mgrit.problems", "mgrit.app", "benchmarks")
    assert _offending(_files("comm"), ("mgrit.core", "mgrit.execute") + above) == []
    assert _offending(_files("execute"), ("mgrit.core",) + above,
                      allowed=("mgrit.core.propagator",)) == []


def _library() -> list[Path]:
    """Every module of the package but the tool's (mgrit.app, and `python -m mgrit`)."""
    return [p for p in PACKAGE.rglob("*.py") if "app" not in p.relative_to(PACKAGE).parts
            and p.name != "__main__.py"]


def test_no_library_module_imports_the_tools_or_the_benchmarks():
    library = _library()
    assert _offending(library, ("mgrit.app", "benchmarks")) == []
    assert _offending(_files("kernels"), ("mgrit.nn", "mgrit.core", "mgrit.comm")) == []
    # the tool hands `mgrit bench` to the benchmarks lazily, and only there
    tool = _offending(_files("app"), ("benchmarks",))
    assert tool == ["mgrit/app/cli.py imports benchmarks", "mgrit/app/cli.py imports "
                    "benchmarks.bench"]


def test_the_network_engine_never_imports_the_public_network_modules():
    # mgrit/nn's public modules (LayerParallel, blocks, checkpoints, controller...) build on
    # mgrit/nn/engine; the engine stays below them so it can change without touching the API
    engine = _files("nn", "engine")
    # public modules, and public packages (the controller) by their folder
    public = sorted(p for p in PACKAGE.joinpath("nn").glob("*.py") if p.name != "__init__.py")
    public += sorted(p.parent for p in PACKAGE.joinpath("nn").glob("*/__init__.py")
                     if p.parent.name != "engine")
    assert {p.stem for p in engine} >= {"passes", "propagators", "stack", "ghosts", "gradients"}
    assert {p.stem for p in public} >= {"layer_parallel", "blocks", "checkpoint", "controller"}
    assert _offending(engine, tuple(f"mgrit.nn.{p.stem}" for p in public) + ("mgrit.nn",),
                      allowed=("mgrit.nn.engine",)) == []
    doc = ast.get_docstring(ast.parse(PACKAGE.joinpath("nn", "engine", "__init__.py")
                                      .read_text()))
    assert doc and len(doc.split()) >= 8


def test_mpi4py_is_imported_by_the_mpi_communicator_alone():
    found = _offending(_library(), ("mpi4py",))
    assert found and {line.split()[0] for line in found} == {"mgrit/comm/mpi.py"}


@pytest.mark.parametrize("code", [
    "import mgrit",
    "import mgrit; from mgrit.nn import LayerParallel; import mgrit.problems",
])
@pytest.mark.slow
def test_importing_the_library_loads_none_of_the_tools_dependencies(code):
    probe = (f"{code}; import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('sklearn', 'matplotlib', 'yaml', 'scipy', 'mpi4py', 'benchmarks') "
             "or m.startswith('mgrit.app')))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=True)
    assert proc.stdout.strip() == "[]"


def test_the_library_imports_itself_only_relatively():
    """So that a copy of the package loads under another name: `python -m benchmarks.ab`
    times versions side by side in one process that way."""
    absolute = [line for path in _library()
                for line in [f"{path.relative_to(ROOT)} imports {module}"
                             for module in _absolute_imports(path)]]
    assert absolute == []


def _absolute_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "mgrit"]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found += [node.module] if node.module.split(".")[0] == "mgrit" else []
    return found
