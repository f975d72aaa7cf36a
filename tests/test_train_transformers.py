"""`mgrit train` of transformers: the character language model (gpt on topics) and the
vision transformer (vit on digits), on one process and two ranks, serially, resumed, and
the settings that do not go together."""

import json
import math
from pathlib import Path

import pytest
import torch

from mgrit.app import data
from mgrit.app.loop import sequence_cross_entropy
from mgrit.app.settings import SettingsError, check, load, parse_override

import runs
from runs import records

# tiny networks and epochs of 3 steps: each run takes seconds
SMALL = ["--steps", "4", "--width", "8", "--set", "network.heads=2", "--batch-size", "8",
         "--set", "training.steps_per_epoch=3", "--levels", "2",
         "--set", "forward.relax=\"F\"", "--set", "backward.relax=\"F\"", "--no-progress"]
# the fixed cost model: the runs below are compared with the `lm` fixture's, and launches
# that measure their prices may choose apart on a busy machine (test_train_cli.FIXED_PRICES)
LM = [*SMALL, "--dataset", "topics", "--network", "gpt", "--set", "data.context=16",
      "--set", "network.dropout=0.1", "--set", "control.batching=6"]
GPT = [*LM, "--epochs", "2"]
VIT = [*SMALL, "--dataset", "digits", "--network", "vit", "--set", "network.dropout=0.1",
       "--epochs", "1"]


def mgrit(*args, timeout=120, **options):
    """`runs.mgrit`, with this file's shorter limit: its runs are tiny."""
    return runs.mgrit(*args, timeout=timeout, **options)


def untimed(recs):
    return [{k: v for k, v in r.items() if k not in ("seconds", "seconds_per_step")}
            for r in recs]


def losses(folder):
    return [r["loss"] for r in records(folder) if r["type"] == "step"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A language model trained on one process for 2 epochs of 3 steps, with dropout."""
    out = tmp_path_factory.mktemp("lm") / "run"
    proc = mgrit("train", *GPT, "--out", str(out))
    return out, proc.stdout


@pytest.mark.slow
def test_language_model_trains_and_reports_next_token_metrics(lm):
    out, stdout = lm
    recs = records(out)
    steps = [r for r in recs if r["type"] == "step"]
    epochs = [r for r in recs if r["type"] == "epoch"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [e["epoch"] for e in epochs] == [1, 2]
    for value in [r["loss"] for r in steps] + [e[k] for e in epochs
                                               for k in ("train_loss", "test_loss")]:
        assert math.isfinite(value) and 0 < value < 10
    assert all(0 <= e[k] <= 1 for e in epochs for k in ("train_accuracy", "test_accuracy"))
    assert f"test loss {epochs[-1]['test_loss']:.4f}, next-token accuracy " in stdout
    # the exported network predicts every next character of the test windows as the
    # evaluation counted them
    split = data.topics(context=16)
    model = torch.load(out / "model.pt", weights_only=False).eval()
    with torch.no_grad():
        logits = model(split.x_test)
    assert logits.shape == (*split.y_test.shape, split.classes)
    assert float(sequence_cross_entropy(logits, split.y_test)) == pytest.approx(
        epochs[-1]["test_loss"], rel=1e-4)
    accuracy = float((logits.argmax(-1) == split.y_test).float().mean())
    assert accuracy == pytest.approx(epochs[-1]["test_accuracy"], abs=1e-3)


@pytest.mark.mpi
def test_language_model_on_two_ranks_trains_as_on_one(lm, tmp_path):
    out = tmp_path / "run"
    mgrit("train", *GPT, "--out", str(out), ranks=2)
    assert losses(out) == pytest.approx(losses(lm[0]), rel=1e-5)
    assert sorted(p.name for p in (out / "checkpoint-0002").iterdir()) == [
        "meta.json", "rank00000-of-00002.pt", "rank00001-of-00002.pt"]


@pytest.mark.slow
def test_serial_training_draws_the_layer_parallel_dropout(lm, tmp_path):
    """--serial trains the same network: same weights, data and dropout masks, so its
    losses are the layer-parallel run's up to MGRIT's inexact solves."""
    out = tmp_path / "serial"
    mgrit("train", *GPT, "--serial", "--out", str(out))
    assert losses(out) == pytest.approx(losses(lm[0]), rel=1e-4)


@pytest.mark.slow
def test_resumed_language_model_continues_the_draws(lm, tmp_path):
    """A run resumed after epoch 1 continues with the dropout draws of step 4, as the
    uninterrupted run did: every record after the resume is that run's."""
    out = tmp_path / "run"
    mgrit("train", *LM, "--epochs", "1", "--out", str(out))
    mgrit("train", *LM, "--epochs", "2", "--out", str(out), "--resume")
    assert untimed(records(out)) == untimed(records(lm[0]))


@pytest.mark.slow
def test_compare_trains_the_language_model_both_ways_with_the_same_settings(tmp_path):
    out = tmp_path / "cmp"
    mgrit("compare", *GPT, "--ranks", "1", "--out", str(out))
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert runs["layer-parallel"]["test_loss"] == pytest.approx(runs["serial"]["test_loss"],
                                                                rel=1e-4)
    assert "Accuracy: of the next-token predictions" in (out / "summary.md").read_text()
    used = {}
    for label in ("serial", "layer-parallel"):
        settings = json.loads((out / label / "settings.json").read_text())
        assert settings["training"].pop("serial") == (label == "serial")
        del settings["output"]["dir"], settings["output"]["label"]
        used[label] = settings
    assert used["serial"] == used["layer-parallel"]
    assert used["serial"]["network"]["kind"] == "gpt"


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_vision_transformer_trains_on_digits(tmp_path, ranks):
    out = tmp_path / "run"
    proc = mgrit("train", *VIT, "--out", str(out), ranks=ranks)
    recs = records(out)
    assert len([r for r in recs if r["type"] == "step"]) == 3
    epoch = recs[-1]
    assert epoch["type"] == "epoch" and math.isfinite(epoch["test_loss"])
    assert all(math.isfinite(r["loss"]) for r in recs if r["type"] == "step")
    assert f"test accuracy {epoch['test_accuracy'] * 100:.2f}%" in proc.stdout


@pytest.mark.parametrize("overrides,words", [
    (["network.kind=gpt"], "[network] kind = 'gpt' is a language model: it needs text data"),
    (["data.name=topics"], "[data] name = 'topics' is text (token ids): train it with "
                           "[network] kind = 'gpt', not 'dense'"),
    (["data.name=topics", "network.kind=conv"], "train it with [network] kind = 'gpt', not "
                                                "'conv'"),
    (["data.name=peaks", "network.kind=vit"], "[network] kind = 'vit' needs image data"),
    (["network.kind=vit", "network.width=10"], "[network] width = 10 must be a multiple of "
                                               "heads = 4"),
    (["data.name=topics", "network.kind=gpt", "network.heads=3"], "width = 32 must be a "
                                                                  "multiple of heads = 3"),
    (["network.kind=vit", "network.patch=3"], "[network] patch = 3 must divide the 8x8 "
                                              "images of digits"),
    (["network.dropout=1.0"], "[network] dropout must lie in [0, 1)"),
    (["data.context=0"], "[data] context must be >= 1"),
    (["training.steps_per_epoch=-1"], "[training] steps_per_epoch must be >= 0"),
])
def test_settings_that_do_not_go_together_are_named(overrides, words):
    with pytest.raises(SettingsError, match=words.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        check(load(None, [parse_override(text) for text in overrides]))


@pytest.mark.slow
def test_mismatched_network_fails_before_any_file(tmp_path):
    out = tmp_path / "out"
    proc = mgrit("train", "--dataset", "digits", "--network", "gpt", "--out", str(out),
                 check=False)
    assert proc.returncode == 2
    assert "[network] kind = 'gpt' is a language model" in proc.stderr
    assert not out.exists()


def test_the_w4_and_w5_configurations_hold_the_workloads_sizes():
    examples = Path(__file__).parent.parent / "examples"
    w4 = check(load(examples / "w4.toml"))
    assert (w4.data.name, w4.data.context, w4.network.kind, w4.network.width, w4.network.heads,
            w4.network.steps, w4.network.dropout, w4.training.batch_size) == \
        ("topics", 64, "gpt", 64, 4, 32, 0.1, 16)
    w5 = check(load(examples / "w5.toml"))
    assert (w5.data.name, w5.network.kind, w5.network.steps, w5.network.patch) == \
        ("digits", "vit", 16, 2)
