"""Ctrl-C and SIGTERM during `mgrit train`: every rank ends within moments, and rank 0 says
in two lines what was kept and the command that continues the run; no rank prints a
traceback.

Under mpiexec the launcher passes Ctrl-C on to every rank. Each rank's handler ends its
process at once (`os._exit`): unwinding would run cleanup that waits on other ranks, which
may be gone. Nothing is lost that a resume needs: checkpoints are written to a temporary
folder and renamed when complete, and a resume cuts the metrics back to its checkpoint.

The message comes from whichever rank handles the signal first, not always from rank 0:
Python runs a signal handler only between bytecodes, so a rank blocked in an MPI wait
handles it only when the wait returns, and once another rank has ended the launcher kills
it first. The ranks agree on a marker file in the output directory; the rank that creates
it speaks.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

# flags that a resumed run must not repeat
_DROPPED = {"--resume", "--overwrite", "--reset-optimizer"}


def resume_command(argv: list[str], ranks: int) -> str:
    """The command that continues the run that `argv` (sys.argv of `mgrit train ...`)
    started on `ranks` ranks."""
    args = [a for a in argv[1:] if a not in _DROPPED] + ["--resume"]
    prefix = (f"mpiexec -n {ranks} python -m mpi4py -m mgrit" if ranks > 1 else "mgrit")
    return f"{prefix} {shlex.join(args)}"


def kept(out: Path) -> str:
    """What a resume would start from: the checkpoint `latest` names, if any."""
    latest = out / "latest"
    try:
        name = latest.read_text().strip()
    except OSError:
        return (f"no checkpoint in {out} yet (one is written at the end of every epoch); "
                "start the run again")
    within = re.fullmatch(r"checkpoint-(\d+)-step(\d+)", name)   # --checkpoint-every
    return (f"kept: {out / name} (step {int(within[2])} of epoch {int(within[1]) + 1})"
            if within else f"kept: {out / name} (the last completed epoch)")


def message(signum: int, out: Path, argv: list[str], ranks: int) -> str:
    name = signal.Signals(signum).name
    lines = [f"mgrit train: stopped by {name} on all {ranks} ranks; {kept(out)}"
             if ranks > 1 else f"mgrit train: stopped by {name}; {kept(out)}"]
    if (out / "latest").exists():
        lines.append(f"continue with: {resume_command(argv, ranks)}")
    return "\n".join(lines) + "\n"


MARKER = ".stopped-"


def install(world: Any, settings: Any, argv: list[str]) -> None:
    """SIGINT and SIGTERM end this rank at once; the first rank to handle one writes
    `message`. Collective (the ranks agree on the marker's name)."""
    rank = world.Get_rank() if world is not None else 0
    ranks = world.Get_size() if world is not None else 1
    out = Path(settings.output.dir)
    job = world.bcast(os.getpid() if rank == 0 else None, root=0) if world is not None \
        else os.getpid()

    def first() -> bool:
        try:
            os.close(os.open(out / f"{MARKER}{job}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False
        except OSError:        # no output directory yet: rank 0 speaks
            return rank == 0

    def handler(signum: int, frame: Any) -> None:
        try:
            if first():
                sys.stderr.write(message(signum, out, argv, ranks))
                sys.stderr.flush()
        except Exception:  # noqa: BLE001 - the process ends either way
            pass
        os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def stopped(command: str) -> int:
    """Ctrl-C where no handler was installed: `mgrit train` before training started (while
    settings or data load), or another command."""
    said = (" before training started; nothing was written" if command == "train" else "")
    sys.stderr.write(f"mgrit {command}: interrupted{said}\n")
    return 128 + signal.SIGINT
