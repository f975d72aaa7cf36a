"""What a training run leaves behind and a resume needs: removing the leftovers of an
interrupted or failed run before anything is rewritten, the message of a checkpoint that
could not be written, and the refusals and notices of `--resume`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ..nn.engine.atomic import WriteError, write_atomically
from .settings import SettingsError

# what an interrupted run leaves: half-written checkpoint folders, the stop markers of
# `interrupts`, the temporary files of the trace, the export and of metrics being cut back
LEFTOVERS = (".checkpoint-*.tmp", ".stopped-*", ".trace.json.tmp", "metrics.jsonl.tmp",
             "model.pt.tmp")


def remove_leftovers(out: Path) -> None:
    """Delete the run's own temporary files in `out`. A resume does this before it
    rewrites metrics.jsonl: on a full disk, the room they take may be what that needs."""
    for pattern in LEFTOVERS:
        for stale in out.glob(pattern):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def not_written(out: Path, folder: Path, name: str, err: WriteError, alone: bool
                ) -> WriteError:
    """The error of a checkpoint that could not be written (`err` names the file and
    why): it says that the earlier checkpoint is kept and how to go on from it. With one
    rank (`alone`) the half-written `folder` is removed too; with several, other ranks may
    still be writing into it, and the next start removes it."""
    if alone:
        shutil.rmtree(folder, ignore_errors=True)
    latest = out / "latest"
    kept = (f"the earlier checkpoint {out / latest.read_text().strip()} is kept: --resume "
            "continues from it" if latest.exists() else "no earlier checkpoint exists")
    return WriteError(err.errno, f"checkpoint {name} was not written: {err}; {kept}",
                      err.filename)


def data_parallel_refusal(replicas: int, ranks: int, resume: bool) -> str:
    """The error of a number of ranks that `replicas` data-parallel replicas cannot share;
    on resume the value is the checkpoint's, which cannot change."""
    if not resume:
        return (f"[training] data_parallel = {replicas} must divide the {ranks} ranks")
    return (f"--resume: the checkpoint was written with [training] data_parallel = "
            f"{replicas}, which must divide the {ranks} ranks (a data-parallel checkpoint "
            f"keeps its number of replicas): resume on a multiple of {replicas} ranks, or "
            "read its weights as a plain network's with "
            "mgrit.nn.serial_state_dict(CHECKPOINT_FOLDER)")


def checkpoint_name(epochs_done: int, partial: dict[str, Any] | None) -> str:
    """checkpoint-NNNN after NNNN epochs, checkpoint-NNNN-stepKKKKKK after KKKKKK steps of
    the next one (`--checkpoint-every`): in that order by name, as they were written."""
    name = f"checkpoint-{epochs_done:04d}"
    return name if partial is None else f"{name}-step{partial['step']:06d}"


def resume_notice(folder: Path, epochs_done: int, partial: dict[str, Any] | None) -> str:
    """What `--resume` says it continues from."""
    if partial is None:
        return f"resuming from {folder}: epoch {epochs_done} done\n"
    return (f"resuming from {folder}: epoch {epochs_done + 1} at step {partial['step']} "
            f"(epoch {epochs_done} done)\n")


def truncate_metrics(path: Path, epochs_done: int, last_step: int | None) -> None:
    """Keep the metrics of what the checkpoint holds: the epochs up to `epochs_done` and,
    of a checkpoint within the next epoch, its step and probe records up to the training
    step numbered `last_step`, and the records of the launches that trained them (a launch
    record holds the step it started at). A last line cut short (the run was killed while
    writing it) is dropped; any other unreadable line is an error naming the file and
    line."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                break
            raise SettingsError(f"--resume: {path} line {number} is not a JSON record "
                                f"({err}); the file is corrupt") from None
        if record.get("epoch", 0) <= epochs_done or (
                last_step is not None and record.get("type") in ("step", "probe", "launch")
                and record.get("step", 0) <= last_step):
            kept.append(line)
    write_atomically(path, lambda f: f.write("".join(s + "\n" for s in kept).encode()))
