"""`mgrit train` and `mgrit compare` end to end, settings, data sets and failure modes."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from mgrit.app import data
from mgrit.app.replay import Interconnect, load_traces, replay, step_spans
from mgrit.app.settings import SettingsError, load, parse_override

from runs import mgrit, records

TINY = ["--epochs", "2", "--steps", "8", "--width", "8", "--no-progress",
        "--set", "forward.levels=2", "--set", "backward.levels=2",
        "--set", "forward.relax=\"F\"", "--set", "backward.relax=\"F\""]
# the controller's fixed cost model: two launches compared record for record must price
# settings alike, and each launch that measures its prices (the default) measures its own,
# so that on a busy machine they may choose different settings at a probe
FIXED_PRICES = ["--set", "control.batching=6"]


# settings ---------------------------------------------------------------------------------

def test_settings_from_toml_yaml_and_overrides(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[data]\nname = "peaks"\n[network]\nwidth = 16\nsteps = 64\n'
                    '[forward]\nlevels = 4\nrelax = ["F", "FCF", "FCF"]\n[training]\nlr = 0.1\n')
    s = load(toml, [parse_override("training.epochs=3"), parse_override("network.kind=dense")])
    assert (s.data.name, s.network.width, s.network.steps, s.training.lr, s.training.epochs) == \
        ("peaks", 16, 64, 0.1, 3)
    assert s.solver("forward").levels == 4 and s.solver("forward").relax_at(1) == "FCF"
    yaml = tmp_path / "run.yaml"
    yaml.write_text("training:\n  optimizer: adam\n  batch_size: 16\n")
    s = load(yaml)
    assert s.training.optimizer == "adam" and s.training.batch_size == 16


@pytest.mark.parametrize("content,words", [
    ("[network]\nwidht = 3\n", "unknown key 'widht' in [network]; valid keys: kind, width"),
    ("[netwrk]\nwidth = 3\n", "unknown section [netwrk]; valid sections: data, network"),
    ('[data]\nname = "imagenet"\n', "'imagenet' is not valid; choose one of 'digits', 'peaks'"),
    ("[training]\nepochs = 0\n", "[training] epochs must be >= 1"),
    ('[training]\nlr = "fast"\n', "[training] lr must be a number"),
    ('[forward]\nrelax = "CF"\n', "[forward] relax='CF' is not valid"),
    ("[forward]\nlevles = 3\n", "unknown key 'levles' in [forward]; valid keys: levels"),
    ("[output]\ntrace = -1\n", "[output] trace must be >= 0"),
    ("[control]\nbatching = -1\n", "[control] batching must be >= 0"),
])
def test_bad_settings_are_named(tmp_path, content, words):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    with pytest.raises(SettingsError, match=words.replace("[", r"\[").replace("]", r"\]")):
        load(path)


@pytest.mark.slow
def test_bad_setting_on_the_command_line_fails_before_any_file(tmp_path):
    out = tmp_path / "out"
    proc = mgrit("train", "--out", str(out), "--set", "training.optimzer=adam", check=False)
    assert proc.returncode == 2
    assert "unknown key 'optimzer' in [training]; valid keys:" in proc.stderr
    assert not out.exists()


@pytest.mark.slow
def test_unwritable_output_directory_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = mgrit("train", *TINY, "--out", str(blocker / "out"), check=False)
    assert proc.returncode == 2
    assert f"output directory {blocker / 'out'} cannot be written" in proc.stderr
    assert blocker.read_text() == "not a directory"


@pytest.mark.parametrize("flags,words", [
    (["--serial", "--trace", "2"], "[output] trace = 2: traces record layer-parallel training"),
    (["--trace", "39"], "[output] trace = 39: the first epoch has 39 steps; at most steps - 1"),
])
@pytest.mark.slow
def test_impossible_trace_settings_fail_before_any_file(tmp_path, flags, words):
    proc = mgrit("train", *TINY, *flags, "--out", str(tmp_path / "o"), check=False)
    assert proc.returncode == 2
    assert words in proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_missing_optional_dependency_is_a_clear_error(tmp_path):
    proc = mgrit("train", *TINY, "--dataset", "mnist", "--out", str(tmp_path / "o"),
                 check=False)
    assert proc.returncode == 2
    assert "the mnist data set needs torchvision" in proc.stderr
    assert not (tmp_path / "o").exists()


# data sets --------------------------------------------------------------------------------

def test_peaks_is_deterministic_balanced_and_two_dimensional():
    a, b = data.peaks(2000), data.peaks(2000)
    assert torch.equal(a.x_train, b.x_train) and a.feature_shape == (2,) and a.classes == 5
    counts = torch.bincount(torch.cat([a.y_train, a.y_test]), minlength=5)
    assert counts.min() > 300            # quintile levels: about 400 per class
    assert float(a.x_train.abs().max()) <= 3.0
    assert data.peaks_levels() == pytest.approx(data.PEAKS_LEVELS, abs=1e-4)


def test_mnist1d_is_generated_offline():
    split = data.mnist1d(samples=500)
    assert split.feature_shape == (40,) and split.classes == 10
    assert len(split.x_train) + len(split.x_test) == 500


def test_torchvision_style_data_sets_are_converted():
    class StandIn:                      # the .data/.targets layout of torchvision data sets
        def __init__(self, n, colour):
            shape = (n, 6, 6, 3) if colour else (n, 6, 6)
            self.data = torch.randint(0, 256, shape, dtype=torch.uint8)
            self.targets = list(range(n))
    grey = data.from_torchvision_sets(StandIn(10, False), StandIn(4, False), classes=10)
    assert grey.feature_shape == (1, 6, 6) and float(grey.x_train.max()) <= 1.0
    colour = data.from_torchvision_sets(StandIn(10, True), StandIn(4, True), classes=10)
    assert colour.feature_shape == (3, 6, 6) and colour.y_test.tolist() == [0, 1, 2, 3]


# runs -------------------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_train_writes_metrics_checkpoints_and_export(tmp_path, ranks):
    out = tmp_path / "run"
    proc = mgrit("train", *TINY, "--out", str(out), ranks=ranks)
    recs = records(out)
    steps = [r for r in recs if r["type"] == "step"]
    epochs = [r for r in recs if r["type"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [1, 2] and len(steps) == 2 * (1258 // 32)
    assert len(steps[0]["forward_residuals"]) == 2 and len(steps[0]["backward_residuals"]) == 1
    assert (out / "latest").read_text() == "checkpoint-0002"
    files = sorted(p.name for p in (out / "checkpoint-0002").iterdir())
    assert files == ["meta.json"] + [f"rank{r:05d}-of-{ranks:05d}.pt" for r in range(ranks)]
    model = torch.load(out / "model.pt", weights_only=False)
    split = data.digits()
    with torch.no_grad():
        correct = int((model(split.x_test).argmax(1) == split.y_test).sum())
    assert correct == round(epochs[-1]["test_accuracy"] * len(split.y_test))
    assert f"test accuracy {epochs[-1]['test_accuracy'] * 100:.2f}%" in proc.stdout


@pytest.mark.mpi
def test_trace_records_steps_that_replay_near_their_measured_times(tmp_path):
    """A traced run trains exactly like an untraced one; its trace holds every rank's
    compute, messages and collectives and replays to completion, every step taking longer
    on a slower network. (How close a replay comes to the measured time is a timing
    question: the scaling study's validation, on a quiet machine.)"""
    plain, traced = tmp_path / "plain", tmp_path / "traced"
    one = ["--epochs", "1", "--no-checkpoint", *FIXED_PRICES]
    mgrit("train", *TINY, *one, "--out", str(plain), ranks=2)
    mgrit("train", *TINY, *one, "--trace", "4", "--out", str(traced), ranks=2)
    losses = [[r["loss"] for r in records(out) if r["type"] == "step"] for out in (plain, traced)]
    assert losses[0] == losses[1] and len(losses[0]) == 1258 // 32
    traces, meta = load_traces(traced / "trace.json")
    assert len(traces) == 2 and meta["ranks"] == 2 and meta["first_step"] == 2
    assert {"compute", "send", "wait", "collective", "mark"} <= {e[0] for t in traces for e in t}
    pred = replay(traces, Interconnect(latency=1e-6, bandwidth=5e9, overhead=1e-6))
    spans = step_spans(pred)
    assert len(spans) == len(meta["step_seconds"]) == 4 and min(spans) > 0
    # every step exchanges messages between the two ranks: a slower network lengthens each
    slower = step_spans(replay(traces, Interconnect(latency=1e-3, bandwidth=5e9, overhead=1e-6)))
    assert all(b > a + 1e-3 for a, b in zip(spans, slower))
    proc = mgrit("replay", str(traced / "trace.json"), "--latency", "1e-6")
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in
            (["1"], ["2"], ["3"], ["4"])]
    assert [r[0] for r in rows] == ["1", "2", "3", "4"]
    assert [r[2] for r in rows] == [f"{m * 1e3:.2f}ms" for m in meta["step_seconds"]]


@pytest.mark.slow
def test_replay_of_a_file_that_is_no_trace_is_a_clear_error(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text('{"loss": 1.0}')
    proc = mgrit("replay", str(path), check=False)
    assert proc.returncode == 2 and "is not a trace file of format 1" in proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_resume_continues_exactly_as_an_uninterrupted_run(tmp_path, ranks):
    warm = ["--set", "forward.initial_guess=\"warm\"", "--set", "backward.initial_guess=\"warm\"",
            *FIXED_PRICES]
    whole, split = tmp_path / "whole", tmp_path / "split"
    mgrit("train", *TINY, *warm, "--epochs", "3", "--out", str(whole), ranks=ranks)
    mgrit("train", *TINY, *warm, "--epochs", "2", "--out", str(split), ranks=ranks)
    mgrit("train", *TINY, *warm, "--epochs", "3", "--out", str(split), "--resume", ranks=ranks)
    a, b = records(whole), records(split)
    strip = [{k: v for k, v in r.items() if k not in ("seconds", "seconds_per_step")} for r in a]
    assert strip == [{k: v for k, v in r.items() if k not in ("seconds", "seconds_per_step")}
                     for r in b]
    ma = torch.load(whole / "model.pt", weights_only=False).state_dict()
    mb = torch.load(split / "model.pt", weights_only=False).state_dict()
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def _calibration(folder):
    """The controller's measured prices in a run's latest checkpoint (rank 0's file)."""
    checkpoint = folder / (folder / "latest").read_text().strip()
    state = torch.load(next(checkpoint.glob("rank00000-*.pt")), weights_only=False)
    return state["extra"]["control"]["calibration"]


@pytest.mark.slow
def test_controller_measures_its_prices_and_a_resumed_run_keeps_them(tmp_path):
    measured, fixed = tmp_path / "measured", tmp_path / "fixed"
    mgrit("train", *TINY, "--epochs", "2", "--out", str(measured))
    kept = _calibration(measured)
    assert kept is not None and kept["forward"] and kept["backward"]
    mgrit("train", *TINY, "--epochs", "3", "--out", str(measured), "--resume")
    assert _calibration(measured) == kept
    mgrit("train", *TINY, "--epochs", "1", "--set", "control.batching=6", "--out", str(fixed))
    assert _calibration(fixed) is None


@pytest.mark.slow
def test_resume_of_a_different_network_is_refused(tmp_path):
    out = tmp_path / "run"
    mgrit("train", *TINY, "--out", str(out))
    before = sorted(p.name for p in out.iterdir())
    proc = mgrit("train", *TINY, "--width", "12", "--out", str(out), "--resume", check=False)
    assert proc.returncode == 2
    assert "--resume cannot change network.width (the checkpoint's 8, now 12)" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == before


@pytest.mark.slow
def test_interrupted_run_leaves_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "mgrit", "train", *TINY, "--epochs", "500",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (out / "latest").exists() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    done = int((out / "latest").read_text().split("-")[1])
    resumed = mgrit("train", *TINY, "--epochs", str(done + 1), "--out", str(out), "--resume")
    epochs = [r["epoch"] for r in records(out) if r["type"] == "epoch"]
    assert epochs == list(range(1, done + 2))
    assert "test accuracy" in resumed.stdout


@pytest.mark.mpi
def test_compare_writes_figures_table_and_json(tmp_path):
    out = tmp_path / "cmp"
    proc = mgrit("compare", *TINY, "--ranks", "2", "--out", str(out), "--solver-study",
                 timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == {"serial", "layer-parallel"}
    assert summary["runs"]["layer-parallel"]["ranks"] == 2
    # each run's one launch, on its own ranks
    assert [[launch["ranks"] for launch in summary["runs"][label]["launches"]]
            for label in ("serial", "layer-parallel")] == [[1], [2]]
    for name in summary["figures"] + ["convergence.png"]:
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
    table = (out / "summary.md").read_text()
    assert "| serial | 1 |" in table and "| layer-parallel | 2 |" in table
    study = json.loads((out / "convergence.json").read_text())
    assert set(study) == {"dahlquist", "heat", "trained network"}
    fcf = next(r for r in study["heat"] if r["label"] == "FCF m=2 L=3")
    assert fcf["residuals"][-1] < 1e-8 * fcf["residuals"][0]
    assert "| layer-parallel | 2 |" in proc.stdout


@pytest.mark.mpi
def test_data_parallel_run_trains_like_one_replica_on_the_full_batch(tmp_path):
    single, replicas = tmp_path / "single", tmp_path / "replicas"
    mgrit("train", *TINY, *FIXED_PRICES, "--out", str(single), "--no-checkpoint")
    mgrit("train", *TINY, *FIXED_PRICES, "--out", str(replicas), "--no-checkpoint",
          "--data-parallel", "2", ranks=2)
    a = [r for r in records(single) if r["type"] == "epoch"]
    b = [r for r in records(replicas) if r["type"] == "epoch"]
    assert [r["epoch"] for r in a] == [r["epoch"] for r in b] == [1, 2]
    for x, y in zip(a, b):
        assert y["train_loss"] == pytest.approx(x["train_loss"], rel=1e-4)
        assert y["test_loss"] == pytest.approx(x["test_loss"], rel=1e-4)


@pytest.mark.slow
def test_serial_resume_continues_exactly_and_a_damaged_checkpoint_is_named(tmp_path):
    """--serial runs checkpoint too: resumed, they continue as an uninterrupted run; a
    truncated serial.pt is named, with the earlier intact checkpoint to fall back to."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    mgrit("train", *TINY, "--serial", "--epochs", "3", "--out", str(whole))
    mgrit("train", *TINY, "--serial", "--epochs", "2", "--out", str(split))
    mgrit("train", *TINY, "--serial", "--epochs", "3", "--out", str(split), "--resume")
    strip = [{k: v for k, v in r.items() if k not in ("seconds", "seconds_per_step")}
             for r in records(whole)]
    again = [{k: v for k, v in r.items() if k not in ("seconds", "seconds_per_step")}
             for r in records(split)]
    assert strip == again and sum(r["type"] == "epoch" for r in again) == 3
    ma = torch.load(whole / "model.pt", weights_only=False).state_dict()
    mb = torch.load(split / "model.pt", weights_only=False).state_dict()
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)

    latest = split / (split / "latest").read_text().strip() / "serial.pt"
    data = latest.read_bytes()
    latest.write_bytes(data[: len(data) // 2])
    proc = mgrit("train", *TINY, "--serial", "--epochs", "4", "--out", str(split), "--resume",
                 check=False)
    assert proc.returncode == 2
    assert "serial.pt cannot be read" in proc.stderr and "truncated or corrupt" in proc.stderr
    assert "checkpoint-0002" in proc.stderr      # the intact one before it
