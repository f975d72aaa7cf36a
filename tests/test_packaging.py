"""What a wheel installs: every package folder of the source tree is in pyproject.toml's
package list (it is a list, since the CUDA sources install from the top-level cuda/ folder
as the data package mgrit.cuda; the C sources are the data package mgrit.kernels.csrc),
and the kernels' build recipes read the sources that the package data names."""

import fnmatch
import sys
from pathlib import Path

from mgrit.kernels import build

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _folder(package: str) -> Path:
    mapped = CONFIG.get("package-dir", {})
    return ROOT / mapped.get(package, package.replace(".", "/"))


def test_every_package_folder_is_listed():
    found = {".".join(init.parent.relative_to(ROOT).parts)
             for top in ("mgrit", "benchmarks") for init in (ROOT / top).rglob("__init__.py")}
    listed = set(CONFIG["packages"])
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    # data only, no __init__.py (listed, so that setuptools installs them as packages)
    assert listed - found == {"mgrit.cuda", "mgrit.kernels.csrc"}
    assert all(_folder(p).is_dir() for p in listed)


def test_the_build_recipes_read_the_files_the_package_data_installs():
    data = CONFIG["package-data"]
    installed = {path.resolve() for package, patterns in data.items()
                 for pattern in patterns for path in _folder(package).glob(pattern)}
    sources = {path.resolve() for recipe in build.RECIPES.values() for path in recipe.sources}
    assert sources <= installed
    assert {p.name for p in (ROOT / "cuda").iterdir()} == {"residual_dense.cu"}
    assert all(fnmatch.fnmatch(p.name, "*.cu") for p in build.CUDA.sources)
    assert "__global__" in build.CUDA.sources[0].read_text()
    assert all(p.suffix == ".c" and p.parent.name == "csrc" for p in build.C.sources)
