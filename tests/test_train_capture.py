"""[training] capture (`--capture`): `mgrit train` with every step on static buffers, as
`mgrit.nn.CapturedStep` (a serial network's as one graph). On the CPU the steps run
eagerly, so a captured run must give the eager run's numbers to the bit; what a capture
cannot hold is refused before any work. (On a GPU: tests/test_train_device.py.)"""

import pytest
import torch

from mgrit.app.cli import build_parser, settings_from
from mgrit.app.network import make_optimizer
from mgrit.app.settings import SettingsError, check, load
from mgrit.app.train import Run

from runs import mgrit, records

# two epochs (an evaluation between them) of four steps each
SMALL = ["--dataset", "peaks", "--epochs", "2", "--steps", "8", "--width", "8", "--no-progress",
         "--set", "training.steps_per_epoch=4", "--set", "forward.levels=2",
         "--set", "backward.levels=2"]


def train(folder, *flags, resume=False):
    """`mgrit train *flags --out folder` in this process, as the command runs it on one
    rank (a process of its own would cost seconds of imports a run)."""
    args = build_parser().parse_args(["train", *SMALL, *flags, "--out", str(folder)])
    Run(check(settings_from(args)), resume=resume).run()


def _losses(folder, kind="step", key="loss"):
    return [r[key] for r in records(folder) if r["type"] == kind]


@pytest.mark.parametrize("serial,optimizer", [(False, "sgd"), (False, "adam"), (True, "adam")],
                         ids=["layer-parallel-sgd", "layer-parallel-adam", "serial-adam"])
def test_captured_training_gives_the_eager_numbers(tmp_path, serial, optimizer):
    """Both epochs' losses, accuracies and test losses, and the residual histories read
    after each step from the device norms; the layer-parallel SGD run also cut after the
    first epoch and resumed, captured again, as it would have gone on."""
    flags = ["--no-control", "--optimizer", optimizer] + (["--serial"] if serial else [])
    eager, captured = tmp_path / "eager", tmp_path / "captured"
    train(eager, *flags)
    train(captured, *flags, "--capture")
    assert len(_losses(captured)) == 8
    assert _losses(captured) == _losses(eager)
    for key in ("test_loss", "train_accuracy"):     # the latter counts the step's outputs
        assert _losses(captured, "epoch", key) == _losses(eager, "epoch", key)
    if serial:
        return
    assert (_losses(captured, key="forward_residuals")
            == _losses(eager, key="forward_residuals"))
    assert all(len(r) == 2 for r in _losses(captured, key="forward_residuals"))
    if optimizer == "sgd":
        cut = tmp_path / "cut"
        train(cut, *flags, "--capture", "--epochs", "1")
        train(cut, *flags, "--capture", resume=True)
        assert _losses(cut) == _losses(eager)


def test_the_controller_probes_a_captured_run(tmp_path):
    out = tmp_path / "out"
    train(out, "--capture")
    probes = [r for r in records(out) if r["type"] == "probe"]
    assert probes and probes[0]["step"] == 1
    assert 0 <= probes[0]["error"] < 1


@pytest.mark.mpi
def test_captured_training_on_two_ranks_gives_one_ranks_numbers(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    train(one, "--no-control")
    mgrit("train", *SMALL, "--no-control", "--capture", "--out", str(two), ranks=2,
          timeout=240)
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-6)


@pytest.mark.parametrize("values,message", [
    ({"data": {"name": "topics"}, "network": {"kind": "gpt", "dropout": 0.1}},
     r"capture = true and \[network\] dropout = 0.1: dropout's keys are made on the host"),
    ({"output": {"trace": 2}}, r"capture = true and \[output\] trace = 2"),
    ({"forward": {"tol": 1e-6}}, r"capture = true and \[forward\] tol = 1e-06: .* set "
                                 r"forward\.tol = 0"),
    ({"backward": {"cuda_graphs": True}}, r"capture = true and \[backward\] cuda_graphs = "
                                          r"true: .*graphs do not nest"),
])
def test_what_a_capture_cannot_hold_is_refused_by_the_settings(values, message):
    settings = load(overrides=[values, {"training": {"capture": True}}])
    with pytest.raises(SettingsError, match=message):
        check(settings)
    settings.training.capture = False
    check(settings)


def test_a_refused_capture_writes_nothing(tmp_path):
    out = tmp_path / "out"
    run = mgrit("train", *SMALL, "--capture", "--set", "forward.tol=1e-6", "--out", str(out),
                check=False)
    assert run.returncode == 2 and "forward.tol = 0" in run.stderr
    assert not out.exists()


@pytest.mark.parametrize("device,capture,capturable", [
    ("cuda", True, True), ("cuda", False, False), ("cpu", True, False)])
def test_adam_keeps_its_step_count_on_the_device_where_a_graph_updates_it(
        device, capture, capturable):
    settings = load(overrides=[{"training": {"optimizer": "adam", "device": device,
                                             "capture": capture}}])
    optimizer = make_optimizer(settings, [torch.nn.Parameter(torch.ones(2))])
    assert optimizer.param_groups[0]["capturable"] is capturable


def test_a_checkpoint_of_a_captured_gpu_run_resumes_on_the_cpu(tmp_path):
    """Adam in a captured run on a GPU keeps its step counts on the device
    (capturable=True), and a restored optimizer takes that flag from the checkpoint, which
    torch refuses on the host. A resumed run sets it as its own settings say. Here the
    checkpoint of a CPU run is given a GPU run's flag."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    flags = ["--serial", "--optimizer", "adam"]
    train(whole, *flags)
    train(cut, *flags, "--epochs", "1")
    path = cut / (cut / "latest").read_text().strip() / "serial.pt"
    state = torch.load(path, weights_only=False)
    for group in state["optimizer"]["param_groups"]:
        group["capturable"] = True
    torch.save(state, path)
    train(cut, *flags, resume=True)
    assert _losses(cut) == _losses(whole)


@pytest.fixture
def replayed_as_graphs(monkeypatch):
    """The run's captured steps go through their CUDA stages (warm-up, capture, replays)
    with the CPU stand-in of tests/emulated_graphs.py, whose replays run the recorded
    operations alone, as a graph runs its kernels: nothing of the step's Python runs again.
    Its layers compute with torch's kernels, which the recording sees (mgrit's native ones
    it would not). Returns the stand-ins made."""
    from functools import partial

    from emulated_graphs import EmulatedCapture
    from mgrit.app import models

    made = []

    class Replayed(models.CapturedStep):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.graphs, self._capturer = True, EmulatedCapture()
            made.append(self._capturer)

    class ReplayedOneGraph(models.OneGraphStep):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.graphs, self._capturer = True, EmulatedCapture()
            made.append(self._capturer)

    monkeypatch.setattr(models, "LayerParallel", partial(models.LayerParallel, kernels="torch"))
    monkeypatch.setattr(models, "CapturedStep", Replayed)
    monkeypatch.setattr(models, "OneGraphStep", ReplayedOneGraph)
    return made


@pytest.mark.parametrize("serial", [False, True], ids=["layer-parallel", "serial"])
def test_a_captured_run_replayed_without_python_gives_the_eager_numbers(
        tmp_path, replayed_as_graphs, serial):
    """Two epochs of SGD with momentum (Adam keeps its step count on the host, which only
    on a GPU it need not), an evaluation and a checkpoint between them; layer-parallel, the
    controller too, its costs modelled (measured ones would make the two runs decide
    apart): its first probe moves the solvers to exact stepping, which the captured step
    captures again, and it probes after replays. What the command does between the steps
    of a captured run leaves the graph's numbers those of eager training."""
    flags = ["--serial"] if serial else ["--set", "control.batching=4",
                                         "--set", "control.every=2"]
    eager, captured = tmp_path / "eager", tmp_path / "captured"
    train(eager, *flags)
    train(captured, *flags, "--capture")
    capturer, = replayed_as_graphs
    assert _losses(captured) == _losses(eager)
    for key in ("test_loss", "train_accuracy"):
        assert _losses(captured, "epoch", key) == _losses(eager, "epoch", key)
    if serial:
        # eager, warm-up, capture; the other five steps replays
        assert (capturer.warm_ups, capturer.captured, capturer.replays) == (1, 1, 5)
        return
    settings = [r["control"]["setting"] for r in records(captured) if r["type"] == "step"]
    assert settings == ["2/1 L2 m4 FCF"] + ["exact"] * 7
    probed = [r["step"] for r in records(captured) if r["type"] == "probe"]
    assert probed == [1, 3, 7] == [r["step"] for r in records(eager) if r["type"] == "probe"]
    # step 1 eager; from step 2 (exact) again eager, eager under the guard, captured; steps
    # 5 to 8 replays (the probe of step 7 after one)
    assert (capturer.warm_ups, capturer.captured, capturer.replays) == (3, 1, 4)
    assert (_losses(captured, key="forward_residuals")
            == _losses(eager, key="forward_residuals"))
