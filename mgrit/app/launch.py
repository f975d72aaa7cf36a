"""Launching programs under mpiexec, and the JSON their ranks hand back.

Every launch of this project goes through `run`: `mpiexec -n P python -m mpi4py ARGS`, one
thread per rank, in a process group of its own that is killed whole when the launch runs
past its timeout or the caller is interrupted or terminated (SIGTERM, as `timeout` and batch
schedulers end a job), so that no rank outlives it. A worker hands
results back with `report(obj)`: each rank that calls it writes `rank-NNNNN.json` into the
folder that `run` created for the launch and named in $MGRIT_REPORT_DIR; the caller finds
them in `Launch.reports`, by rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPORT_DIR = "MGRIT_REPORT_DIR"


def find_mpiexec() -> str | None:
    """$MGRIT_MPIEXEC, else the mpiexec beside this Python (MPICH from PyPI), else PATH's;
    None when there is none."""
    configured = os.environ.get("MGRIT_MPIEXEC")
    if configured:
        return configured
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    return shutil.which("mpiexec")


def mpiexec() -> str:
    """`find_mpiexec`, or an error that says how to name one."""
    found = find_mpiexec()
    if found is None:
        raise FileNotFoundError(f"no mpiexec found (none beside {sys.executable}, none on "
                                "PATH); set MGRIT_MPIEXEC")
    return found


def command(ranks: int, args: list[str], mpi4py: bool = True) -> list[str]:
    """`mpiexec -n ranks python -m mpi4py ARGS`. With `mpi4py=False` plain `python ARGS`,
    where an error on one rank ends the others only if the program itself sees to it."""
    runner = ["-m", "mpi4py"] if mpi4py else []
    return [mpiexec(), "-n", str(ranks), sys.executable, *runner, *args]


class LaunchError(RuntimeError):
    """A launch that ran past its timeout or ended with a non-zero exit status."""


@dataclass
class Launch:
    """What one launch produced: exit status, output, wall-clock seconds and the reports of
    the ranks that called `report` (rank -> object)."""

    command: list[str]
    ranks: int
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    reports: dict[int, Any] = field(default_factory=dict)

    def check(self) -> "Launch":
        """This launch, if it ended in time with exit status 0; else LaunchError with its
        error output (its output, where that holds both)."""
        said = self.stderr or self.stdout
        if self.timed_out:
            raise LaunchError(f"{' '.join(self.command)} did not finish in time; its ranks "
                              f"were killed:\n{said}")
        if self.returncode != 0:
            raise LaunchError(f"{' '.join(self.command)} ended with exit status "
                              f"{self.returncode}:\n{said}")
        return self


def run(ranks: int, args: list[str], timeout: float | None, mpi4py: bool = True,
        env: dict[str, str] | None = None, merge_output: bool = False) -> Launch:
    """Launch ARGS (what follows `python`, e.g. ["-m", "mgrit", "train"]) on `ranks` ranks
    and wait for it, at most `timeout` seconds (None: as long as it takes). `env` adds to
    this process's environment; `merge_output` collects stderr into stdout, in the order
    written. The launch's ranks are killed when it times out or this process is
    interrupted."""
    cmd = command(ranks, args, mpi4py)
    with tempfile.TemporaryDirectory(prefix="mgrit-launch-") as folder:
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}), REPORT_DIR: folder}
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=full_env,
                                stderr=subprocess.STDOUT if merge_output else subprocess.PIPE,
                                start_new_session=True)
        timed_out = False
        try:
            with _ended_with_the_caller(proc):
                out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            out, err = proc.communicate()
        except BaseException:
            # in a session of its own the launch does not get the terminal's Ctrl-C
            _kill_group(proc)
            proc.wait()
            raise
        seconds = time.perf_counter() - start
        reports = {int(path.stem.split("-")[1]): json.loads(path.read_text())
                   for path in sorted(Path(folder).glob("rank-*.json"))}
    return Launch(cmd, ranks, proc.returncode, out, err or "", seconds, timed_out, reports)


@contextlib.contextmanager
def _ended_with_the_caller(proc: subprocess.Popen) -> Iterator[None]:
    """While inside: SIGTERM to this process ends the launch first. In a session of its
    own the launch gets no signal sent to this process's group, and a process ended by
    SIGTERM runs no cleanup, so its ranks would run on. The ranks get SIGTERM (`mgrit
    train` then says what it kept), and whatever is left a few seconds later is killed;
    then the signal does what it did before: this process's own handler, or its end.
    Where SIGTERM is ignored, or outside the main thread (which alone takes handlers),
    nothing changes."""
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN or threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.SIG_DFL if previous is None else previous

    def handler(signum: int, frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        _kill_group(proc)       # a rank whose mpiexec is gone is no longer waited for
        signal.signal(signal.SIGTERM, before)
        if callable(before):
            before(signum, frame)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, before)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill mpiexec and every rank it started (its process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def report(obj: Any, rank: int | None = None) -> None:
    """In a launched program: hand `obj` (anything JSON can hold) back to the caller of
    `run`, as this rank's report (the rank of MPI.COMM_WORLD unless given)."""
    folder = os.environ.get(REPORT_DIR)
    if folder is None:
        raise RuntimeError(f"report() is for programs started by mgrit.app.launch.run, which "
                           f"names their report folder in ${REPORT_DIR}; it is not set here")
    if rank is None:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    tmp = Path(folder) / f".rank-{rank:05d}.json.tmp"
    tmp.write_text(json.dumps(obj))
    tmp.rename(tmp.with_name(f"rank-{rank:05d}.json"))  # whole, or not there at all


def free_port() -> int:
    """A TCP port nobody listens on now, for the gloo baselines' rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
