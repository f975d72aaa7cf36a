"""The output directory of a training run: which of its files are results, checking that
it can be written and is not another run's, and making a written checkpoint the `latest`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from .resuming import remove_leftovers
from .settings import SettingsError

# what a run writes into its output directory (besides checkpoint-NNNN folders)
RESULT_FILES = ("settings.json", "metrics.jsonl", "latest", "model.pt", "trace.json")
KEPT_CHECKPOINTS = 2


def results_in(folder: Path) -> list[Path]:
    """The files and folders of a run's results in `folder`."""
    if not folder.is_dir():
        return []
    named = [folder / n for n in RESULT_FILES if (folder / n).exists()]
    return named + sorted(folder.glob("checkpoint-*"))


def refuse_used(folder: Path, overwrite: bool) -> None:
    """The error for a folder that holds another run's results, unless `overwrite`."""
    results = results_in(folder)
    if results and not overwrite:
        names = ", ".join(p.name for p in results[:4]) + (", ..." if len(results) > 4 else "")
        raise SettingsError(f"{folder} holds the results of another run ({names}); pass "
                            "--resume to continue it, --overwrite to replace it, or choose "
                            "another output directory")


def prepare_output(out: Path, resume: bool, overwrite: bool) -> None:
    """Check that `out` can be written and holds what `resume` needs (a checkpoint) or may
    be used (no other run's results, or `overwrite`: those are removed); then remove what
    an interrupted run left there."""
    if resume and overwrite:
        raise SettingsError("--resume continues the run in the output directory and "
                            "--overwrite replaces it: choose one")
    existed = out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise OSError(f"output directory {out} cannot be written: {err}") from None
    finally:
        if not existed and out.exists() and not any(out.iterdir()):
            out.rmdir()
    if resume and not (out / "latest").exists():
        raise SettingsError(f"--resume: no checkpoint in {out} (no 'latest' file)")
    if not resume:
        refuse_used(out, overwrite)
        for path in results_in(out):      # --overwrite: the other run's results only
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    # before a resume rewrites metrics.jsonl, which may need the room they take
    remove_leftovers(out)


def latest_checkpoint(out: Path) -> Path:
    """The folder `latest` names."""
    return out / (out / "latest").read_text().strip()


def publish_checkpoint(out: Path, written: Path, name: str, meta: dict[str, Any]) -> None:
    """Make the complete checkpoint in `written` the folder `name` and point `latest` at
    it (each by a rename, so an interruption leaves the previous one in place)."""
    (written / "meta.json").write_text(json.dumps(meta, indent=2))
    final = out / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(written, final)
    latest = out / ".latest.tmp"
    latest.write_text(name)
    os.replace(latest, out / "latest")
    # the previous checkpoint stays: if the newest turns out unreadable (a disk that lost
    # it), there is one to go back to
    for old in sorted(out.glob("checkpoint-*"))[:-KEPT_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)


def intact_hint(out: Path, bad: str) -> str:
    """How to resume from the checkpoint before the unreadable `bad`, if one is kept."""
    earlier = sorted(p.name for p in out.glob("checkpoint-*") if p.name < bad)
    if not earlier:
        return ""
    return (f". The earlier checkpoint {out / earlier[-1]} is kept: to resume from "
            f"it, write its name into {out / 'latest'} (echo {earlier[-1]} > "
            f"{out / 'latest'}) and resume again")
