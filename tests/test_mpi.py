"""The distributed solver under mpiexec: the same numbers as the serial one, and clean failures."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import MPI_SCRIPTS

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_distributed_solve_equals_serial(mpi, nprocs):
    """Dahlquist (real, complex), heat and dense ResNet, float64 and float32, N = 5, 37, 61, 64
    (and 600 for Dahlquist), V/F cycles, F/FCF, 2-5 levels, zero/nested/tensor guesses, loop
    and batched execution."""
    run = mpi("solve_vs_serial.py", nprocs, timeout=240)
    assert run.returncode == 0, run.stderr
    for rank, report in run.by_rank().items():
        assert report["cases"] == 208
        assert report["failures"] == [], f"rank {rank}: {report['failures']}"


@pytest.mark.parametrize("nprocs,failing,runner", [(2, 1, True), (3, 0, True), (4, 2, True),
                                                   (3, 1, False)])
def test_exception_on_one_rank_ends_every_rank(mpi, nprocs, failing, runner):
    """Under `python -m mpi4py` and under plain `python` (mgrit's own abort hook)."""
    # a rank left waiting would run into the launch's timeout, which fails the test
    run = mpi("fault.py", nprocs, str(failing), timeout=60, abort_on_error=runner)
    assert run.returncode != 0
    assert f"RuntimeError: deliberate failure on rank {failing}" in run.stderr
    assert f"mgrit: raised on rank {failing} of {nprocs}" in run.stderr
    assert run.reports() == [], "no rank may finish the solve"


@pytest.mark.parametrize("what", ["config", "num_steps", "dtype", "values"])
def test_settings_that_differ_between_ranks_are_reported_everywhere(mpi, what):
    run = mpi("mismatch.py", 3, what, timeout=60)
    assert run.returncode != 0
    reports = run.by_rank()
    assert sorted(reports) == [0, 1, 2], run.stderr
    for rank, report in reports.items():
        assert report["error"] and "differ between ranks" in report["error"], (rank, report)
        if what == "values":
            # equal values whose reprs differ agreed; the differing shapes did not
            assert report["error"].startswith("a batch shape differ"), (rank, report)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_persistent_messages_carry_new_contents_at_every_start(mpi, nprocs):
    """The boundary values' persistent requests on MPI: started four times round a ring of
    ranks (float64 and complex64, plain and reversed numbering), every round delivers that
    round's contents from the right neighbour, and MPI finalizes without naming a request
    left unfreed, nor complaining at shutdown."""
    run = mpi("persistent.py", nprocs, timeout=120)
    assert run.returncode == 0, run.stderr
    for rank, got in run.by_rank().items():
        assert got["persistent"], rank
        assert len(got["results"]) == 16
        for received, expected in got["results"]:
            assert received == expected, rank
    assert "persistent request" not in run.stderr
    # nor does a request that outlives the script complain at interpreter shutdown
    assert "Exception ignored" not in run.stderr, run.stderr


@pytest.mark.parametrize("level", ["single", "funneled", "serialized", "multiple"])
def test_a_cuda_training_pass_needs_an_mpi_that_any_thread_may_call(mpi, level):
    """On CUDA autograd runs the backward pass (the adjoint's messages, the replicas'
    averaging) on a thread of its own: an MPI started for the main thread alone refuses
    the training pass before it starts, on every rank; on the CPU the backward runs on the
    caller's thread and trains at every level as serial autograd does."""
    run = mpi("thread_level.py", 2, level, timeout=60, abort_on_error=False)
    assert run.returncode == 0, run.stderr
    one_thread = level in ("single", "funneled")
    for rank, report in run.by_rank().items():
        assert report["provided"] == ["single", "funneled", "serialized",
                                      "multiple"].index(level)
        for name, message in report["refused"].items():
            if one_thread:
                assert message is not None, (rank, name)
                assert f"MPI was started with MPI_THREAD_{level.upper()}" in message
                assert "on a thread of its own" in message
            else:
                assert message is None, (rank, name, message)
        assert report["asked"] == ["cpu"], (rank, report)
        assert report["grad_error"] < 1e-12, (rank, report)


@pytest.mark.parametrize("nprocs", [1, 2])
def test_a_communicator_of_one_rank_moves_nothing(mpi, nprocs):
    """A one-replica data communicator (of a one-rank world, and of two layer-parallel
    ranks): its collectives make no MPI call (none copies a CUDA tensor to the host inside
    a captured step) and leave what they are given; training on it equals serial
    autograd."""
    run = mpi("one_rank.py", nprocs, timeout=60)
    assert run.returncode == 0, run.stderr
    for rank, report in run.by_rank().items():
        assert report["calls"] == [] and report["same"], (rank, report)
        assert report["data_size"] == 1
        assert report["grad_error"] < 1e-12, (rank, report)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie waiting to be reaped has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.parametrize("own_handler", [False, True])
def test_a_launcher_ended_by_sigterm_ends_its_ranks(mpi, tmp_path, own_handler):
    """`timeout` and batch schedulers end a job with SIGTERM, which a launch in a session
    of its own does not get: the launcher ends its ranks first, then ends as the signal
    would have ended it, or runs its own handler (here one that exits with status 3)."""
    handler = ("signal.signal(signal.SIGTERM, lambda *_: sys.exit(3)); " if own_handler
               else "")
    code = (f"import signal, sys; from mgrit.app import launch; {handler}"
            f"launch.run(2, [{str(MPI_SCRIPTS / 'sleeper.py')!r}, {str(tmp_path)!r}], "
            "timeout=120)")
    parent = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        assert len(pids) == 2 and all(map(_alive, pids))
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=30) == (3 if own_handler else -signal.SIGTERM)
        deadline = time.monotonic() + 10
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, pids)), "a rank outlived its launcher"
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
        for pid in [int(p.read_text()) for p in tmp_path.glob("*.pid")]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
