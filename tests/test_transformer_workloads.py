"""The transformer workloads W4 and W5 (benchmarks.workloads), their benchmark rows
(benchmarks.training, benchmarks.baselines), their scaling cases and the accuracy-parity
script (benchmarks.transformers), at tiny sizes."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from mgrit.app import launch
from mgrit.app.loop import train_step
from mgrit.core.config import Config
from mgrit.nn import draws

from benchmarks import training, transformers
from benchmarks.scaling import study
from benchmarks.scaling.cases import CURVES, SERIAL_DEPTHS, TRANSFORMER_CURVES, ScalingCase
from benchmarks.workloads import (TRAINING_WORKLOADS, W4_SETTINGS, topics_corpus,
                                  w4_workload, w5_workload)

from conftest import mpiexec_path

ROOT = Path(__file__).resolve().parent.parent
# 16 layers: the smallest depth the default 3-level hierarchy (coarsening 4) accepts
TINY_W4 = dict(width=16, heads=2, num_steps=16, context=8, batch=4)
TINY_W5 = dict(width=16, heads=2, num_steps=16, batch=8)
ONE_LEVEL = Config(levels=1, tol=0.0, max_iter=1)


def _tiny(name: str, **solver):
    work = (w4_workload(**TINY_W4) if name == "w4" else w5_workload(**TINY_W5))
    return work.with_solver(**solver) if solver else work


def test_w4_and_w5_are_registered_with_the_documented_sizes():
    assert {"w4", "w5"} <= set(TRAINING_WORKLOADS)
    w4, w5 = TRAINING_WORKLOADS["w4"](), TRAINING_WORKLOADS["w5"]()
    x, y = w4.inputs(torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (16, 64) and x.dtype == torch.long
    # y is x shifted by one character: next-character targets
    assert torch.equal(x[:, 1:], y[:, :-1])
    spec = w4.network()
    assert spec.num_steps == 32 and spec.step().causal and spec.step().p == 0.1
    assert w4.forward.max_iter == 2 and w4.backward.max_iter == 1 and w4.forward.levels == 3
    images, labels = w5.inputs(torch.Generator().manual_seed(0))
    assert images.shape == (32, 1, 8, 8) and labels.shape == (32,)
    assert len(set(labels.tolist())) > 1 and w5.network().num_steps == 16


@pytest.mark.parametrize("name", sorted(TRAINING_WORKLOADS))
def test_either_network_of_a_workload_leaves_the_generator_in_the_same_state(name):
    """The benchmarks build only the network they time: the layer-parallel model and the
    serial network draw the same initial weights, so the draws after either (dropout in
    W4) do not depend on which was built."""
    work = TRAINING_WORKLOADS[name]()
    model = training.parallel_model(work, seed=3)
    after_model = torch.random.get_rng_state()
    serial = training.serial_network(work, seed=3)
    assert torch.equal(torch.random.get_rng_state(), after_model)
    exported, built = model.to_serial().state_dict(), serial.state_dict()
    assert list(exported) == list(built)
    assert all(torch.equal(exported[k], built[k]) for k in built)


@pytest.mark.parametrize("name", ["w4", "w5"])
def test_one_training_step_of_serial_and_layer_parallel_gives_a_finite_loss(name):
    work = _tiny(name)
    model, serial = training.build(work)
    x, y = work.inputs(torch.Generator().manual_seed(1))
    for net in (serial, model):
        optimizer = work.optimizer(net.parameters())
        loss, out = train_step(net, optimizer, work.loss, x, y)
        assert math.isfinite(float(loss))
    vocab = len(topics_corpus().vocab)
    assert out.shape == ((4, 8, vocab) if name == "w4" else (8, 10))


def test_levels1_gradients_of_w4_equal_serial_with_the_same_dropout_draws():
    """Sequential stepping through LayerParallel (levels=1) is serial autograd, dropout
    included, when the serial pass runs inside the model's draws."""
    work = _tiny("w4").with_solver(levels=1, relax="F", max_iter=1)
    model, serial = training.build(work)
    x, y = work.inputs(torch.Generator().manual_seed(1))
    with draws(model.draw_seed, model.draw_step):
        serial_loss = work.loss(serial(x), y)
    serial_loss.backward()
    loss = work.loss(model(x), y)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(serial_loss.detach()), rel=1e-6)
    for mine, ref in training.gradient_pairs(model, serial):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-7)
    # the draws matter: serial dropout from torch's generator gives another loss
    with torch.no_grad():
        assert float(work.loss(serial(x), y)) != pytest.approx(float(serial_loss), rel=1e-6)


def test_gradient_quality_of_w4_compares_passes_with_the_same_draws():
    exact = training.gradient_quality(_tiny("w4", levels=1, relax="F", max_iter=1))
    assert exact["cosine"] == pytest.approx(1.0, abs=1e-6)
    assert exact["relative_error"] < 1e-5 and exact["output_relative_error"] < 1e-6
    mgrit = training.gradient_quality(_tiny("w4"))
    assert 0.9 < mgrit["cosine"] < 1.0 + 1e-9 and mgrit["relative_error"] < 0.5


def test_layer_parallel_methods_time_w4_without_a_torch_kernel_row():
    # a transformer block has no native kernels: no "torch kernels" row to compare with
    rows = training.layer_parallel_methods(_tiny("w4"), repeats=1)
    assert set(rows) == {"layer-parallel mgrit", training.SEQUENTIAL}
    assert rows["layer-parallel mgrit"]["stats"]["forward"]["iterations"] == 2


BASELINES = f"""
import json, math, torch
from mpi4py import MPI
from mgrit.app import launch
from mgrit.app.loop import train_step
from benchmarks.baselines import GPipe, LayerwiseModelParallel
from benchmarks.training import build
from benchmarks.workloads import w4_workload, w5_workload

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
out = {{}}
for name, work in (("w4", w4_workload(**{TINY_W4!r})), ("w5", w5_workload(**{TINY_W5!r}))):
    x, y = work.inputs(torch.Generator().manual_seed(1))
    model, serial = build(work, comm=comm)
    loss, _ = train_step(model, work.optimizer(model.parameters()), work.loss, x, y)
    layerwise = LayerwiseModelParallel(serial, comm, x, work.loss, work.optimizer)
    _, serial = build(work)
    gpipe = GPipe(serial, comm, work.microbatches, work.loss, work.optimizer)
    out[name] = {{"mgrit": float(loss), "layerwise": layerwise.train_step(x, y),
                 "gpipe": gpipe.train_step(x, y)}}
launch.report(out)
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_baselines_and_two_ranks_train_w4_and_w5_with_finite_losses():
    """On 2 ranks: layer-wise model parallelism and GPipe take token ids in and logits
    (batch, tokens, vocabulary) out; MGRIT's loss on 2 ranks is its loss on 1."""
    mpiexec_path()
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "MGRIT_GLOO_PORT": str(launch.free_port())}
    done = launch.run(2, ["-c", BASELINES], timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    ranks = done.reports
    for name in ("w4", "w5"):
        work = _tiny(name)
        model, _ = training.build(work)
        x, y = work.inputs(torch.Generator().manual_seed(1))
        one_rank, _ = train_step(model, work.optimizer(model.parameters()), work.loss, x, y)
        for rank in (0, 1):
            assert ranks[rank][name]["mgrit"] == pytest.approx(float(one_rank), rel=1e-5)
        # the last rank holds the closing, so the loss
        assert ranks[0][name]["layerwise"] is None and ranks[0][name]["gpipe"] is None
        assert math.isfinite(ranks[1][name]["layerwise"])
        assert math.isfinite(ranks[1][name]["gpipe"])


def test_parity_training_of_w4_records_its_curve_and_gradient_checks():
    run = transformers.train_w4(transformers.VARIANTS["default"], 2, 1, windows=4, **TINY_W4)
    assert run["method"] == "3 levels, F/FCF, 2/1 cycles" and run["steps"] == 2
    assert [p["step"] for p in run["curve"]] == [0, 1, 2]
    assert all(math.isfinite(p["validation_loss"]) for p in run["curve"])
    assert 0.5 < run["curve"][-1]["gradient_cosine"] <= 1 + 1e-6


@pytest.mark.slow
def test_parity_script_runs_on_a_tiny_config_and_levels1_matches_serial():
    result = transformers.parity(2, 1, 1, ["default", "levels=1"], ["default", "levels=1"],
                                 windows=8, w5_seeds=(1,), w4=TINY_W4,
                                 w5={**TINY_W5, "batch": 256})
    serial, default, exact = result["w4"]
    assert serial["method"] == transformers.SERIAL and len(serial["curve"]) == 3
    assert [p["step"] for p in default["curve"]] == [0, 1, 2]
    assert math.isfinite(default["validation_loss"])
    assert default["curve"][-1]["forward_residual"] > 0 and serial["curve"][-1]["forward_residual"] is None
    # same weights, data, dropout draws and exact gradients: the same training
    assert exact["validation_loss"] == serial["validation_loss"]
    assert exact["parity"] and exact["relative_difference"] == 0.0
    # the gradient checks along the way: exact for levels=1, and they leave training as is
    assert all(p["gradient_relative_error"] < 1e-5 for p in exact["curve"])
    assert 0.5 < default["curve"][-1]["gradient_cosine"] <= 1 + 1e-6
    assert "gradient_cosine" not in serial["curve"][-1]
    w5_serial, _, w5_exact = result["w5"]
    assert w5_serial["steps"] == 4 and w5_exact["difference"] == pytest.approx(0.0)
    spread, = result["w5_serial_seeds"]
    assert spread["seed"] == 1 and "difference" in spread and result["w4_serial_seeds"] == []
    json.dumps(result)
    transformers.print_tables(result)
    assert result["settings"]["w4"]["width"] == 16


def test_parity_script_command_line_refuses_unknown_variants():
    with pytest.raises(SystemExit, match="variants"):
        transformers.main(["--w4-variants", "default,fast"])
    with pytest.raises(SystemExit, match="seeds"):
        transformers.main(["--w5-seeds", "one"])


def test_scaling_cases_build_w4_and_w5_at_any_depth():
    w4 = ScalingCase("w4", "w4", 32, costed=False).work(16)
    assert w4.network().num_steps == 16 and w4.name == "w4"
    assert w4.network().opening.positions.shape == (W4_SETTINGS["context"], 64)
    w5 = ScalingCase("w5", "w5", 16, costed=False, levels=2).work()
    assert w5.network().num_steps == 16 and w5.forward.levels == 2


def test_scaling_cases_run_on_the_rank_counts_they_can_use():
    ranks = [1, *(2 ** k for k in range(1, 11))]
    assert TRANSFORMER_CURVES["w4"].usable(ranks) == [1, 2, 4, 8, 16, 32]
    assert TRANSFORMER_CURVES["w5"].usable(ranks) == [1, 2, 4, 8, 16]
    assert TRANSFORMER_CURVES["w4-1024"].usable(ranks) == [64, 128, 256, 512, 1024]
    # as before: a costed case from 2 ranks, W2 on all
    assert CURVES["w1-1024"].usable(ranks) == ranks[1:] and CURVES["w2"].usable(ranks) == ranks
    assert set(TRANSFORMER_CURVES) <= set(SERIAL_DEPTHS) and set(CURVES) <= set(SERIAL_DEPTHS)


@pytest.mark.parametrize("argv", [["--cases", "w9"], ["--ranks", "2"], ["--cases", "w4",
                                                                        "--ranks", "two"]])
def test_scaling_command_line_refuses_bad_cases_before_running(tmp_path, argv):
    with pytest.raises(SystemExit):
        study.main([str(tmp_path), *argv])
    assert list(tmp_path.iterdir()) == []



def test_parity_training_of_w4_with_the_controller_records_what_it_probed_and_did(monkeypatch):
    variant, default = transformers.VARIANTS["controller"], transformers.VARIANTS["default"]
    assert variant.controlled and not default.controlled
    assert (variant.forward, variant.backward) == (default.forward, default.backward)
    controllers = []

    class Recorded(transformers.Controller):
        def __init__(self, model):
            super().__init__(model)
            controllers.append(self)

    monkeypatch.setattr(transformers, "Controller", Recorded)
    run = transformers.train_w4(variant, 3, 1, windows=4, **TINY_W4)
    controller, = controllers
    assert controller.step == 3 and controller.probes[0]["step"] == 0
    # the error probed at step 0 is the default options' gradient error on the first batch
    # against serial autograd with the same weights and draws
    work = w4_workload(**TINY_W4)
    model = transformers.build_model(work, default, 0)
    x, y = work.inputs(torch.Generator().manual_seed(0))
    exact = transformers.gradient_check(model, work, x, y)["gradient_relative_error"]
    assert run["first_error"] == pytest.approx(exact, rel=1e-3) and exact > 1e-3
    assert run["probes"] == len(controller.probes)
    assert run["probe_seconds"] == pytest.approx(sum(p["seconds"] for p in controller.probes))
    assert run["final_setting"] == controller.setting.label
    assert run["decisions"] == controller.decisions
    # every evaluation after a training step reached the controller's policy
    assert controller.policy.losses == [p["validation_loss"] for p in run["curve"][1:]]
    # training ended with the solvers of the controller's final setting
    assert (controller.model.forward_config, controller.model.backward_config) == \
        controller.configs(controller.setting)
    assert run["method"] == variant.name and math.isfinite(run["validation_loss"])
