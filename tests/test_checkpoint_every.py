"""`--checkpoint-every STEPS`: checkpoints within an epoch, from which a resume continues
exactly as the uninterrupted run (the same data order, metrics and final weights), each
launch recorded with the step it started at."""

import json
import platform

import pytest
import torch

import mgrit as package
from mgrit.app.environment import source_commit
from mgrit.app.resuming import truncate_metrics

from runs import launches, mgrit, records
from test_train_cli import FIXED_PRICES

TINY = ["--steps", "8", "--width", "8", "--no-progress",
        "--set", "forward.levels=2", "--set", "backward.levels=2",
        "--set", "forward.relax=\"F\"", "--set", "backward.relax=\"F\"",
        "--set", "forward.initial_guess=\"warm\"", "--set", "backward.initial_guess=\"warm\"",
        "--set", "training.steps_per_epoch=8"]


def _without_times(folder):
    return [{k: v for k, v in r.items() if k not in ("seconds", "seconds_per_step")}
            for r in records(folder)]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,serial", [(1, []), (2, []), (1, ["--serial"])])
def test_resume_from_within_an_epoch_continues_exactly(tmp_path, ranks, serial):
    fixed = [] if serial else FIXED_PRICES
    whole, split = tmp_path / "whole", tmp_path / "split"
    mgrit("train", *TINY, *serial, *fixed, "--epochs", "2", "--out", str(whole), ranks=ranks)
    mgrit("train", *TINY, *serial, *fixed, "--epochs", "2", "--checkpoint-every", "3",
          "--out", str(split), ranks=ranks)
    # the two latest are kept: 6 steps into epoch 2, and the end of epoch 2
    assert sorted(p.name for p in split.glob("checkpoint-*")) == [
        "checkpoint-0001-step000006", "checkpoint-0002"]
    assert _without_times(split) == _without_times(whole)
    # as if the run had been stopped after step 6 of epoch 2 (14 of 16)
    (split / "latest").write_text("checkpoint-0001-step000006")
    (split / "model.pt").unlink()
    proc = mgrit("train", *TINY, *serial, *fixed, "--epochs", "2", "--out", str(split),
                 "--resume", ranks=ranks)
    assert "epoch 2 at step 6 (epoch 1 done)" in proc.stdout
    assert _without_times(split) == _without_times(whole)
    steps = [r["step"] for r in records(split) if r["type"] == "step"]
    assert steps == list(range(1, 17))
    # the first launch trained steps 1 to 14 (the rest were cut with its later records),
    # the resumed one 15 and 16
    started = [(r["epoch"], r["step"], r["resumed"]) for r in launches(split)]
    assert started == [(1, 1, False), (2, 15, True)]
    for launch in launches(split):
        assert (launch["mgrit"], launch["torch"], launch["ranks"]) == (
            package.__version__, torch.__version__, ranks)
        assert launch["hosts"] == [platform.node()] and launch["devices"] == ["cpu"]
        assert launch["python"] == platform.python_version() and launch["mpi"]
        assert launch["source"] == source_commit()     # the commit of this checkout
    a = torch.load(whole / "model.pt", weights_only=False).state_dict()
    b = torch.load(split / "model.pt", weights_only=False).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_keeps_the_launches_that_trained_what_it_keeps(tmp_path):
    """Cut back to a checkpoint, metrics keep a launch's record if the checkpoint holds a
    step it trained: the launches of earlier epochs, and of the checkpoint's epoch one that
    started at or before its step; a launch that started later trained nothing kept."""
    # four steps an epoch; launched at step 1, again at 7 (resumed within epoch 2), at 9
    # (the start of epoch 3) and at 11
    written = []
    for n in range(1, 13):
        if n in (1, 7, 9, 11):
            written.append({"type": "launch", "epoch": 1 + (n - 1) // 4, "step": n})
        written.append({"type": "step", "epoch": 1 + (n - 1) // 4, "step": n})
    path = tmp_path / "metrics.jsonl"
    for epochs_done, last_step, kept in ((2, 10, [1, 7, 9]), (2, None, [1, 7]), (1, 6, [1]),
                                         (1, 7, [1, 7]), (2, 11, [1, 7, 9, 11])):
        path.write_text("".join(json.dumps(r) + "\n" for r in written))
        truncate_metrics(path, epochs_done, last_step)
        left = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["step"] for r in left if r["type"] == "launch"] == kept
        assert [r["step"] for r in left if r["type"] == "step"] == list(
            range(1, (last_step or 4 * epochs_done) + 1))


def test_checkpoints_within_epochs_without_checkpoints_are_refused(tmp_path):
    out = tmp_path / "run"
    proc = mgrit("train", *TINY, "--checkpoint-every", "3", "--no-checkpoint", "--out",
                 str(out), check=False)
    assert proc.returncode == 2
    assert "[output] checkpoint_every = 3 asks for checkpoints" in proc.stderr
    assert not out.exists()
    proc = mgrit("train", *TINY, "--checkpoint-every", "-1", "--out", str(out), check=False)
    assert proc.returncode == 2
    assert "[output] checkpoint_every must be >= 0" in proc.stderr


def test_an_interrupt_names_a_checkpoint_within_an_epoch(tmp_path):
    from mgrit.app.interrupts import kept
    (tmp_path / "latest").write_text("checkpoint-0001-step000006")
    assert kept(tmp_path) == f"kept: {tmp_path / 'checkpoint-0001-step000006'} (step 6 of epoch 2)"
    (tmp_path / "latest").write_text("checkpoint-0002")
    assert kept(tmp_path) == f"kept: {tmp_path / 'checkpoint-0002'} (the last completed epoch)"


def test_a_run_that_chooses_its_solvers_resumes_with_them(tmp_path):
    """`--choose`: a new run trains with the options `choose_settings` picked on its first
    batch (a "choice" record first in its metrics, a line on stdout); a resume does not
    choose again but takes them from the checkpoint, so that it continues exactly."""
    out = tmp_path / "run"
    proc = mgrit("train", *TINY, "--choose", "--epochs", "2", "--checkpoint-every", "3",
                 "--out", str(out))
    assert "solver options chosen on the first batch: forward " in proc.stdout
    whole = _without_times(out)
    choice = whole[0]
    assert choice["type"] == "choice" and choice["epoch"] == 0
    assert {"levels", "max_iter", "initial_guess"} <= choice["forward"].keys()
    assert [r["type"] for r in whole].count("choice") == 1
    (out / "latest").write_text("checkpoint-0001-step000006")
    (out / "model.pt").unlink()
    proc = mgrit("train", *TINY, "--choose", "--epochs", "2", "--out", str(out), "--resume")
    assert "chosen on the first batch" not in proc.stdout
    # the resumed steps repeat the first run's: the same options, the same records
    assert _without_times(out) == whole
