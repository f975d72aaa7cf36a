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
    """Both epochs' losses, accuracies and test losses, and the residual histories read after each
    step from the device norms; the layer-parallel SGD run also cut after the first epoch
    and resumed, captured again, as it would have gone on."""
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
