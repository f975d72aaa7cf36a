import signal
import threading
from pathlib import Path

import pytest
import torch

from mgrit.app import launch

from needs import cuda_device, missing


def _terminated(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (how `timeout`, as in benchmarks/gpu_check.sh, and batch schedulers end a
    run) interrupts the session as Ctrl-C does: pytest then still writes its reports
    (--junitxml), and a launch in progress ends its ranks (`mgrit.app.launch.run`)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A `gpu`-marked test needs a CUDA device (`needs.cuda_device`)."""
    if item.get_closest_marker("gpu") is not None:
        cuda_device()


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


MPI_SCRIPTS = Path(__file__).parent / "mpi"


def mpiexec_path() -> str:
    """The mpiexec that `mgrit.app.launch` uses; without one the test is skipped, or fails
    under MGRIT_TEST_REQUIRE_ALL=1 (see `needs`)."""
    found = launch.find_mpiexec()
    if found is None:
        missing("no mpiexec: none in $MGRIT_MPIEXEC, beside the Python running the tests, "
                "or on PATH")
    return found


class MPIRun:
    """What one `mpiexec -n P python -m mpi4py SCRIPT` launch produced."""

    def __init__(self, done: launch.Launch):
        self.returncode = done.returncode
        self.stdout = done.stdout
        self.stderr = done.stderr
        self.seconds = done.seconds
        self.nprocs = done.ranks
        self._reports = done.reports

    def reports(self) -> list[dict]:
        """What the ranks handed back with mgrit.app.launch.report, in rank order."""
        return [self._reports[rank] for rank in sorted(self._reports)]

    def by_rank(self) -> dict[int, dict]:
        reports = self._reports
        assert sorted(reports) == list(range(self.nprocs)), (
            f"expected a report from each of {self.nprocs} ranks, got {sorted(reports)}\n"
            f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}")
        return reports


def run_mpi(script: str, nprocs: int, *args: str, timeout: float = 300,
            abort_on_error: bool = True) -> MPIRun:
    """Launch a script of tests/mpi on `nprocs` ranks; a hang fails after `timeout` seconds.

    With `abort_on_error` the script runs under `python -m mpi4py`, as users are told to;
    without, under plain `python`, where mgrit's own abort hook must end the other ranks.
    """
    done = launch.run(nprocs, [str(MPI_SCRIPTS / script), *args], timeout=timeout,
                      mpi4py=abort_on_error)
    if done.timed_out:
        pytest.fail(f"{script} on {nprocs} ranks did not finish in {timeout} s (hang?)\n"
                    f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}")
    return MPIRun(done)


@pytest.fixture
def mpi():
    """`mpi(script, nprocs, *args, timeout=..., abort_on_error=...)` -> MPIRun."""
    mpiexec_path()
    return run_mpi
