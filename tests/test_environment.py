"""`mgrit env`: what mgrit finds on a machine, against what this process finds; a kernel
library or an MPI launch that fails is reported with its reason, not raised."""

import json
import platform
import subprocess
import sys

import pytest
import torch

import mgrit
from mgrit.app.environment import describe, source_commit, text
from mgrit.app.launch import find_mpiexec
from mgrit.kernels import native

from conftest import mpiexec_path


def _mgrit(*args):
    return subprocess.run([sys.executable, "-m", "mgrit", *args], capture_output=True,
                          text=True, timeout=180, check=True).stdout


@pytest.mark.mpi
def test_env_reports_what_this_process_finds():
    """The JSON against this process's own view (the MPI library's, asked in a process of
    its own: importing MPI here would start MPI in the tests' process), the text saying
    the same; two ranks start and pass a message (the tests' mpiexec)."""
    mpiexec_path()
    library = subprocess.run(
        [sys.executable, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
        capture_output=True, text=True, timeout=60, check=True).stdout
    env = json.loads(_mgrit("env", "--json", "--launch"))
    assert (env["mgrit"], env["source"], env["python"], env["torch"], env["executable"]) == (
        mgrit.__version__, source_commit(), platform.python_version(), torch.__version__,
        sys.executable)
    assert env["mpi"] == " ".join(library.splitlines()[0].split()) and env["mpi"]
    assert env["mpiexec"] == find_mpiexec()
    assert env["two_ranks"]["ok"] is True
    built = native.available()
    assert env["native_kernels"]["available"] is built
    if built:
        assert env["native_kernels"] == {"available": True, "library": native.library()._name,
                                         "vector_tanh": native.vector_tanh()}
    assert env["cuda_devices"] == [torch.cuda.get_device_name(i)
                                   for i in range(torch.cuda.device_count())]
    lines = _mgrit("env").splitlines()
    assert lines[0].startswith(f"mgrit {mgrit.__version__}")
    assert f"mpiexec: {find_mpiexec()}" in lines[3]
    if built:
        assert lines[4] == f"native CPU kernels: available ({native.library()._name}" + (
            ", vector tanh)" if native.vector_tanh() else ", scalar tanh)")
    assert not any(line.startswith("two ranks") for line in lines)   # only with --launch


def test_what_fails_is_reported_with_its_reason(monkeypatch):
    """A kernel library that cannot be built, a missing mpi4py and a launcher that fails:
    each is a line saying why, and `mgrit env` still reports the rest."""
    def unbuildable():
        raise RuntimeError("the mgrit native kernels cannot be loaded: no C compiler (cc)")

    monkeypatch.setattr(native, "library", unbuildable)
    monkeypatch.setenv("MGRIT_MPIEXEC", "/bin/false")
    monkeypatch.setitem(sys.modules, "mpi4py", None)     # import mpi4py fails
    env = describe(launch=True)
    assert env["native_kernels"] == {
        "available": False,
        "error": "the mgrit native kernels cannot be loaded: no C compiler (cc)"}
    assert env["mpi4py"] is None and "mpi4py" in env["mpi_error"]
    assert env["two_ranks"]["ok"] is False
    assert "/bin/false -n 2" in env["two_ranks"]["error"]
    assert "ended with exit status 1" in env["two_ranks"]["error"]
    lines = text(env).splitlines()
    assert lines[3].startswith("mpi4py: not importable (") and "mpiexec: /bin/false" in lines[3]
    assert lines[4].startswith("two ranks: failed: /bin/false -n 2")
    assert lines[5] == ("native CPU kernels: not available: the mgrit native kernels cannot "
                        "be loaded: no C compiler (cc)")
    if not torch.cuda.is_available():
        assert lines[6] == "CUDA kernels: not available: no CUDA device"
