"""`mgrit train` and `mgrit compare` as a user meets them: runs never mix, resumes obey the
command line or refuse naming what, errors from any rank reach the user, Ctrl-C ends every
rank with one message, bad settings fail before anything is written."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

from mgrit.app import data
from mgrit.app.settings import load

from conftest import mpiexec_path
from test_train_cli import FIXED_PRICES, TINY, mgrit, records

ROOT = Path(__file__).resolve().parent.parent


def _epochs(folder):
    return [r for r in records(folder) if r["type"] == "epoch"]


# 1. output folders ------------------------------------------------------------------------

@pytest.mark.slow
def test_a_rerun_into_a_used_folder_is_refused_and_overwrite_replaces(tmp_path):
    out = tmp_path / "run"
    mgrit("train", *TINY, "--out", str(out))
    before = (out / "metrics.jsonl").read_text()
    proc = mgrit("train", *TINY, "--out", str(out), check=False)
    assert proc.returncode == 2
    assert f"{out} holds the results of another run" in proc.stderr
    assert "--resume to continue it, --overwrite to replace it" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == before
    mgrit("train", *TINY, "--out", str(out), "--overwrite")
    assert len(_epochs(out)) == 2                  # replaced, not appended
    assert [r["epoch"] for r in _epochs(out)] == [1, 2]


@pytest.mark.slow
def test_compare_refuses_a_used_folder_before_training(tmp_path):
    out = tmp_path / "cmp"
    shown = [a for a in TINY if a != "--no-progress"]
    proc = mgrit("compare", *shown, "--epochs", "1", "--ranks", "1", "--out", str(out))
    # each run's progress lines say which run they belong to
    assert "[serial] epoch 1/1 step 1/39" in proc.stderr
    assert "[layer-parallel] epoch 1/1 step 1/39" in proc.stderr
    stamp = (out / "serial" / "metrics.jsonl").stat().st_mtime_ns
    proc = mgrit("compare", *TINY, "--epochs", "1", "--ranks", "1", "--out", str(out),
                 check=False)
    assert proc.returncode == 2 and "holds the results of another run" in proc.stderr
    assert (out / "serial" / "metrics.jsonl").stat().st_mtime_ns == stamp


# 2. resume semantics ---------------------------------------------------------------------

@pytest.mark.slow
def test_resume_applies_a_new_learning_rate_and_refuses_what_it_cannot_change(tmp_path):
    first = tmp_path / "first"
    mgrit("train", *TINY, "--epochs", "1", "--out", str(first))
    same, faster = tmp_path / "same", tmp_path / "faster"
    shutil.copytree(first, same)
    shutil.copytree(first, faster)
    mgrit("train", "--epochs", "2", "--out", str(same), "--resume")
    mgrit("train", "--epochs", "2", "--lr", "0.5", "--out", str(faster), "--resume")
    assert json.loads((faster / "settings.json").read_text())["training"]["lr"] == 0.5
    meta = json.loads((faster / "checkpoint-0002" / "meta.json").read_text())
    assert meta["settings"]["training"]["lr"] == 0.5
    # the same first epoch, a different second one: the new rate took effect
    assert _epochs(same)[0] == _epochs(faster)[0]
    assert _epochs(same)[1]["train_loss"] != _epochs(faster)[1]["train_loss"]

    proc = mgrit("train", "--epochs", "3", "--width", "16", "--out", str(same), "--resume",
                 check=False)
    assert proc.returncode == 2
    assert "--resume cannot change network.width (the checkpoint's 8, now 16)" in proc.stderr
    proc = mgrit("train", "--epochs", "3", "--optimizer", "adam", "--out", str(same),
                 "--resume", check=False)
    assert proc.returncode == 2
    assert "training.optimizer (the checkpoint's 'sgd', now 'adam')" in proc.stderr
    assert "--reset-optimizer" in proc.stderr
    mgrit("train", "--epochs", "3", "--optimizer", "adam", "--out", str(same), "--resume",
          "--reset-optimizer")
    assert [r["epoch"] for r in _epochs(same)] == [1, 2, 3]


@pytest.mark.slow
def test_resume_when_every_epoch_is_done_says_so(tmp_path):
    out = tmp_path / "done"
    mgrit("train", *TINY, "--out", str(out))
    proc = mgrit("train", "--out", str(out), "--resume")
    assert "nothing to train: the checkpoint in" in proc.stderr
    assert "epoch 2 and [training] epochs = 2" in proc.stderr


# 3. errors from any rank --------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("runner", ["mpi4py", "plain"])
def test_an_unreadable_checkpoint_on_rank_1_is_named_on_every_launch(tmp_path, runner):
    out = tmp_path / "run"
    mgrit("train", *TINY, "--out", str(out), ranks=2)
    bad = out / "checkpoint-0002" / "rank00001-of-00002.pt"
    bad.write_bytes(bad.read_bytes()[:100])
    prefix = [str(mpiexec_path()), "-n", "2", sys.executable]
    prefix += ["-m", "mpi4py"] if runner == "mpi4py" else []
    proc = subprocess.run(prefix + ["-m", "mgrit", "train", "--epochs", "3", "--out", str(out),
                                    "--resume"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    assert ("ranks 0, 1: " in proc.stderr or "rank 1: " in proc.stderr) and str(bad) in proc.stderr
    assert "truncated or corrupt" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("mgrit train: error") == 1
    # the previous checkpoint is named as the one to go back to
    assert f"echo checkpoint-0001 > {out / 'latest'}" in proc.stderr


# 4. any number of levels -------------------------------------------------------------------

@pytest.mark.slow
def test_more_levels_take_their_relaxation_from_the_defaults(tmp_path):
    s = load(None, [{"forward": {"levels": 5}, "backward": {"levels": 5}}])
    assert s.solver("forward").levels == 5 and len(s.forward["relax"]) == 4
    mgrit("train", "--epochs", "1", "--steps", "64", "--width", "8", "--levels", "4",
          "--no-progress", "--out", str(tmp_path / "four"))


# 5. progress under mpiexec -------------------------------------------------------------------

@pytest.mark.mpi
def test_progress_under_mpiexec_prints_lines_during_each_epoch(tmp_path):
    proc = mgrit("train", *[a for a in TINY if a != "--no-progress"], "--out",
                 str(tmp_path / "p"), ranks=2)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("epoch ")]
    assert any(re.match(r"epoch 1/2 step 1/39 loss \S+ acc \S+% fwd \d+ cyc \S+ bwd \d+ cyc \S+ "
                        r"\S+ ms/step$", line) for line in lines), lines
    assert any(line.startswith("epoch 2/2 step 39/39") and "test acc" in line for line in lines)
    assert "\r" not in proc.stderr                 # a pipe gets plain lines


# 6. interrupts -----------------------------------------------------------------------------

@pytest.mark.mpi
def test_ctrl_c_ends_every_rank_with_one_message_and_the_resume_command(tmp_path):
    out = tmp_path / "run"
    cmd = [str(mpiexec_path()), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "mgrit",
           "train", "--epochs", "200", "--steps", "8", "--width", "8", "--levels", "2",
           "--no-progress", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 120
        while not (out / "latest").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (out / "latest").exists()
        os.killpg(proc.pid, signal.SIGINT)         # what Ctrl-C on a terminal does
        out_text, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Traceback" not in err, err
    assert "stopped by SIGINT" in err, (proc.returncode, out_text, err)
    assert err.count("mgrit train: stopped by SIGINT on all 2 ranks; kept: ") == 1
    resume = next(line for line in err.splitlines() if line.startswith("continue with: "))
    assert resume.endswith(f"--out {out} --resume")
    epoch = int((out / "latest").read_text().split("-")[1])
    mgrit("train", "--epochs", str(epoch + 1), "--out", str(out), "--resume", ranks=2)
    assert [r["epoch"] for r in _epochs(out)] == list(range(1, epoch + 2))


# 7. validation before anything is written ---------------------------------------------------

@pytest.mark.parametrize("flags,words", [
    (["--batch-size", "100000"], "[training] batch_size = 100000 is larger than the 1258 "
                                 "training examples of digits"),
    (["--lr", "inf"], "[training] lr must be a finite number, got inf"),
    (["--set", "training.momentum=1.5"], "[training] momentum must lie in [0, 1)"),
    (["--reset-optimizer"], "--reset-optimizer applies to --resume only"),
])
@pytest.mark.slow
def test_settings_that_cannot_work_fail_before_any_file(tmp_path, flags, words):
    out = tmp_path / "o"
    proc = mgrit("train", *TINY, *flags, "--out", str(out), check=False)
    assert proc.returncode == 2 and words in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("flags,words", [
    (["--ranks", "0"], "--ranks 0: the layer-parallel run needs at least 1 rank"),
    (["--serial"], "unrecognized arguments: --serial"),
])
@pytest.mark.slow
def test_compare_refuses_impossible_flags(tmp_path, flags, words):
    proc = mgrit("compare", *TINY, *flags, "--out", str(tmp_path / "c"), check=False)
    assert proc.returncode == 2 and words in proc.stderr
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_resume_drops_a_metrics_line_cut_short_and_names_a_corrupt_one(tmp_path):
    out = tmp_path / "run"
    mgrit("train", *TINY, "--out", str(out))
    metrics = out / "metrics.jsonl"
    text = metrics.read_text()
    metrics.write_text(text + '{"type": "step", "epo')          # killed mid-write
    mgrit("train", "--epochs", "3", "--out", str(out), "--resume")
    assert [r["epoch"] for r in _epochs(out)] == [1, 2, 3]
    lines = metrics.read_text().splitlines()
    lines[3] = "not json"
    metrics.write_text("\n".join(lines) + "\n")
    proc = mgrit("train", "--epochs", "4", "--out", str(out), "--resume", check=False)
    assert proc.returncode == 2
    assert f"{metrics} line 4 is not a JSON record" in proc.stderr


# 8. optional extras -------------------------------------------------------------------------

def test_the_torchvision_hint_keeps_the_installed_torch():
    hint = data.torchvision_hint("2.13.0+cpu")
    assert "pip install --no-deps 'torchvision==0.28.*' pillow" in hint
    assert data.torchvision_hint(torch.__version__).count("--no-deps") == 1
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert not any("torchvision" in dep for deps in extras.values() for dep in deps)


# 9. checkpoints across rank counts ------------------------------------------------------------

@pytest.mark.mpi
def test_a_checkpoint_of_two_ranks_resumes_on_one_exactly(tmp_path):
    single = tmp_path / "single"
    mgrit("train", *TINY, *FIXED_PRICES, "--out", str(single))
    moved = tmp_path / "moved"
    mgrit("train", *TINY, *FIXED_PRICES, "--epochs", "1", "--out", str(moved), ranks=2)
    mgrit("train", "--epochs", "2", "--out", str(moved), "--resume")
    a, b = _epochs(single), _epochs(moved)
    assert [r["epoch"] for r in b] == [1, 2]
    for key in ("train_loss", "test_loss", "test_accuracy"):
        assert b[1][key] == pytest.approx(a[1][key], rel=1e-6, abs=1e-9)


# 10. the smaller things ------------------------------------------------------------------------

@pytest.mark.slow
def test_help_shows_defaults_and_choices():
    proc = mgrit("train", "--help")
    assert "{sgd,adam}" in proc.stdout and "(default: 32)" in proc.stdout
    assert "--overwrite" in proc.stdout and "--reset-optimizer" in proc.stdout


def test_the_license_the_package_declares_is_there():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert declared == "MIT"
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")


def test_the_resume_command_repeats_the_run_without_its_one_off_flags(tmp_path, capsys):
    from mgrit.app import interrupts

    argv = ["/x/mgrit/__main__.py", "train", "--out", "a b", "--overwrite", "--lr", "0.1"]
    assert interrupts.resume_command(argv, 2) == \
        "mpiexec -n 2 python -m mpi4py -m mgrit train --out 'a b' --lr 0.1 --resume"
    assert interrupts.resume_command(argv, 1) == "mgrit train --out 'a b' --lr 0.1 --resume"
    said = interrupts.message(signal.SIGTERM, tmp_path, argv, 1)
    assert said == f"mgrit train: stopped by SIGTERM; no checkpoint in {tmp_path} yet (one is " \
                   "written at the end of every epoch); start the run again\n"
    assert interrupts.stopped("compare") == 130
    assert capsys.readouterr().err == "mgrit compare: interrupted\n"
