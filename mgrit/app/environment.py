"""What mgrit finds on this machine (`mgrit env`): its own version and source, Python,
torch and the CUDA devices it sees, mpi4py with its MPI library and the mpiexec that
`mgrit compare` and the tests launch, and whether the native kernels build and load. The
first thing to run on a new machine, and what a bug report should carry."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

# the folder above the package: a git work tree when mgrit runs from a checkout
SOURCE = Path(__file__).resolve().parents[2]


def source_commit(root: Path = SOURCE) -> str | None:
    """The commit of the git checkout at `root` that mgrit runs from (abbreviated), with
    "+changes" when tracked files differ from it; None for an installed package, or where
    git cannot say. Between releases the version alone does not name the code."""
    if not (root / ".git").exists():
        return None

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=20)

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0 or status.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if status.stdout.strip() else "")


def versions(source: bool = True) -> dict[str, Any]:
    """mgrit's version and (with `source`) the commit it runs from, Python's and torch's:
    what every record of where something ran starts with."""
    import torch

    from .. import __version__

    return {"mgrit": __version__, "source": source_commit() if source else None,
            "python": platform.python_version(), "torch": torch.__version__}


def mpi_library(mpi: ModuleType) -> str:
    """The first line of the MPI library's version (mpi4py's `MPI` module), spaces
    collapsed: "MPICH Version: 5.0.2", "Open MPI v5.0.3, ..."."""
    return " ".join(mpi.Get_library_version().split("\n")[0].split())


def _kernels(library: Callable[[], Any], vector_tanh: Callable[[], bool] | None = None
             ) -> dict[str, Any]:
    """Whether a kernel library builds (into the cache, if it is not there) and loads:
    {"available", "library" (its path) or "error" (why not), "vector_tanh"}."""
    try:
        lib = library()
    except RuntimeError as err:
        return {"available": False, "error": str(err)}
    out: dict[str, Any] = {"available": True, "library": lib._name}
    if vector_tanh is not None:
        out["vector_tanh"] = vector_tanh()
    return out


# two ranks pass a message: what `mgrit compare`, the benchmarks and the MPI tests need
HELLO = ("from mpi4py import MPI; c = MPI.COMM_WORLD; "
         "assert c.Get_size() == 2 and c.allreduce(c.Get_rank() + 1) == 3")


def launch_check(timeout: float = 60.0) -> dict[str, Any]:
    """Two ranks started with `mpiexec -n 2 python -m mpi4py` and an allreduce between
    them: {"ok", "seconds"} or {"ok": False, "error"}."""
    from .launch import LaunchError, run

    try:
        done = run(2, ["-c", HELLO], timeout=timeout, merge_output=True).check()
    except (LaunchError, OSError) as err:
        return {"ok": False, "error": str(err).strip()}
    return {"ok": True, "seconds": round(done.seconds, 2)}


def describe(launch: bool = False) -> dict[str, Any]:
    """Everything `mgrit env` reports, as a dict (its --json); with `launch`, also
    `launch_check`."""
    import torch

    from ..kernels import cuda, native
    from .launch import find_mpiexec

    out: dict[str, Any] = {
        **versions(), "executable": sys.executable,
        "platform": platform.platform(), "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_cuda": torch.version.cuda,
        "cuda_devices": [torch.cuda.get_device_name(i)
                         for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else []}
    try:
        import mpi4py
        from mpi4py import MPI
    except ImportError as err:
        out.update(mpi4py=None, mpi=None, mpi_error=str(err))
    else:
        out.update(mpi4py=mpi4py.__version__, mpi=mpi_library(MPI))
    out["mpiexec"] = find_mpiexec()
    if launch:
        out["two_ranks"] = launch_check()
    out["native_kernels"] = _kernels(native.library, native.vector_tanh)
    out["cuda_kernels"] = (_kernels(cuda.library) if out["cuda_devices"] else
                           {"available": False, "error": "no CUDA device"})
    return out


def text(env: dict[str, Any]) -> str:
    """`mgrit env`'s lines."""
    def kernels(k: dict[str, Any]) -> str:
        if not k["available"]:
            return f"not available: {k['error']}"
        tanh = {True: ", vector tanh", False: ", scalar tanh"}.get(k.get("vector_tanh"), "")
        return f"available ({k['library']}{tanh})"

    def two_ranks(check: dict[str, Any]) -> str:
        if check["ok"]:
            return f"started and passed a message in {check['seconds']} s"
        return f"failed: {check['error']}"

    source = f" (source {env['source']})" if env["source"] else ""
    devices = ", ".join(env["cuda_devices"]) or "none"
    mpi = (f"mpi4py {env['mpi4py']}, {env['mpi']}" if env["mpi4py"]
           else f"mpi4py: not importable ({env['mpi_error']})")
    return "\n".join([
        f"mgrit {env['mgrit']}{source}",
        f"python {env['python']} ({env['executable']}), {env['platform']}, "
        f"{env['cpus']} CPUs",
        f"torch {env['torch']}, {env['torch_threads']} threads, CUDA build "
        f"{env['torch_cuda'] or 'none'}, CUDA devices: {devices}",
        f"{mpi}; mpiexec: {env['mpiexec'] or 'none found'}",
        *([f"two ranks: {two_ranks(env['two_ranks'])}"] if "two_ranks" in env else []),
        f"native CPU kernels: {kernels(env['native_kernels'])}",
        f"CUDA kernels: {kernels(env['cuda_kernels'])}"]) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print it as JSON")
    parser.add_argument("--launch", action="store_true", help="also start two ranks with "
                        "mpiexec and pass a message between them (at most a minute)")


def run(args: argparse.Namespace) -> int:
    env = describe(launch=args.launch)
    sys.stdout.write(json.dumps(env, indent=2) + "\n" if args.json else text(env))
    return 0
