import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch



@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


MPI_SCRIPTS = Path(__file__).parent / "mpi"


class MPIRun:
    """What one `mpiexec -n P python -m mpi4py SCRIPT` launch produced."""

    def __init__(self, proc: subprocess.CompletedProcess, seconds: float, nprocs: int,
                 report_dir: Path):
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.seconds = seconds
        self.nprocs = nprocs
        self.report_dir = report_dir

    def reports(self) -> list[dict]:
        """What the ranks wrote with tests/mpi/reporting.report."""
        return [json.loads(p.read_text()) for p in sorted(self.report_dir.glob("rank-*.json"))]

    def by_rank(self) -> dict[int, dict]:
        reports = {r["rank"]: r for r in self.reports()}
        assert sorted(reports) == list(range(self.nprocs)), (
            f"expected a report from each of {self.nprocs} ranks, got {sorted(reports)}\n"
            f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}")
        return reports


def mpiexec_path() -> Path:
    """The mpiexec of the MPICH that mpi4py in this environment uses."""
    return Path(sys.executable).parent / "mpiexec"


def run_mpi(script: str, nprocs: int, *args: str, report_dir: Path, timeout: float = 300,
            abort_on_error: bool = True) -> MPIRun:
    """Launch a script of tests/mpi on `nprocs` ranks; a hang fails after `timeout` seconds.

    With `abort_on_error` the script runs under `python -m mpi4py`, as users are told to;
    without, under plain `python`, where mgrit's own abort hook must end the other ranks.
    """
    runner = ["-m", "mpi4py"] if abort_on_error else []
    cmd = [str(mpiexec_path()), "-n", str(nprocs), sys.executable, *runner,
           str(MPI_SCRIPTS / script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", MGRIT_REPORT_DIR=str(report_dir))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{script} on {nprocs} ranks did not finish in {timeout} s (hang?)\n"
                    f"stdout:\n{out}\nstderr:\n{err}")
    return MPIRun(subprocess.CompletedProcess(cmd, proc.returncode, out, err),
                  time.perf_counter() - start, nprocs, report_dir)


@pytest.fixture
def mpi(tmp_path):
    """`mpi(script, nprocs, *args, timeout=..., abort_on_error=...)` -> MPIRun."""
    if not mpiexec_path().exists():
        pytest.fail(f"no mpiexec beside {sys.executable}; install the project with its "
                    "dependencies (make test does)")
    counter = iter(range(10 ** 6))

    def launch(script, nprocs, *args, **kwargs):
        folder = tmp_path / f"mpi-{next(counter)}"
        folder.mkdir()
        return run_mpi(script, nprocs, *args, report_dir=folder, **kwargs)

    return launch
