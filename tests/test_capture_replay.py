"""Captured steps and forward passes replayed as a CUDA graph would run them, on the CPU:
`emulated_graphs.EmulatedCapture` records every aten operation of the captured run and its
replays run those operations alone, on the same tensors, with no Python of the step. Numbers
equal to eager training's then show that nothing the replays need is decided or counted on
the host (the stand-in of test_capture replays by running the step's Python again, which
cannot show that). Models compute with torch's kernels, which the recording sees."""

import threading

import pytest
import torch
from torch import nn

import mgrit
from mgrit.nn import CapturedForward, CapturedStep, CaptureError

from emulated_graphs import EmulatedCapture, step_counts_on_the_device
from nets import build, data, loss_fn, optimizer, round_off_equal, train_eagerly
from test_capture import (BACKWARD, FORWARD, STEADY, WARM, batches, eager_run, probed_error,
                          stand_in, transformer_case)


def emulated(captured):
    return stand_in(captured, EmulatedCapture())


# no cycle from a nested start: the cheapest setting, which the GPU check times
NESTED = mgrit.Config(levels=2, coarsening=4, relax="F", tol=0.0, max_iter=0, min_coarse=1,
                      initial_guess="nested")


@pytest.mark.parametrize("kind", ["dense", "gelu", "conv"])
@pytest.mark.parametrize("configs", [(FORWARD, BACKWARD), (WARM, WARM), (NESTED, NESTED)],
                         ids=["zero", "warm", "no cycle"])
def test_replays_without_python_give_the_eager_steps_numbers(kind, configs):
    """Six SGD-momentum steps, the last three replays: losses, residual histories and
    parameters bit for bit; a warm start carries on through the replays."""
    capturer, _ = six_steps_as_eager(kind, configs, "sgd")
    assert len(capturer.graphs[0].ops) > 100


def six_steps_as_eager(kind, configs, opt_name):
    """Six captured steps, the last three replays, checked against eager steps: losses,
    residual histories and parameters bit for bit; the capturer and the optimizer."""
    losses, params, histories = eager_run(kind, opt_name, *configs, 6, kernels="torch")
    model, _ = build(kind, 8, *configs, kernels="torch")
    opt = optimizer(opt_name, model)
    step = CapturedStep(model, loss_fn, opt, *data(kind, 4))
    capturer = emulated(step)
    for k, (x, y) in enumerate(batches(kind, 6)):
        assert step.step(x, y).item() == losses[k]
        assert step.stats()["forward"]["residuals"] == histories[k]["forward"]
        assert step.stats()["backward"]["residuals"] == histories[k]["backward"]
    assert (capturer.warm_ups, capturer.captured, capturer.replays) == (2, 1, 3)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    return capturer, opt


def test_the_emulation_freezes_what_is_decided_on_the_host():
    """Not vacuous: a closing that scales by a number kept in Python (bumped every call)
    trains differently in a replay, which runs the scale it was captured with."""
    class Counting(nn.Linear):
        calls = 0

        def forward(self, x):
            Counting.calls += 1
            return super().forward(x) * (1.0 + 0.1 * Counting.calls)

    def make():
        torch.manual_seed(0)
        return mgrit.LayerParallel(lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh()), 8,
                                   forward=FORWARD, backward=BACKWARD,
                                   opening=nn.Linear(5, 8), closing=Counting(8, 3),
                                   kernels="torch").double()

    pairs = batches("dense", 5)
    model = make()
    Counting.calls = 0
    losses = train_eagerly(model, optimizer("sgd", model), loss_fn, pairs)
    model = make()
    step = CapturedStep(model, loss_fn, optimizer("sgd", model), *pairs[0])
    emulated(step)
    Counting.calls = 0
    got = [step.step(x, y).item() for x, y in pairs]
    assert got[:3] == losses[:3] and got[3:] != losses[3:]


def test_a_step_count_kept_on_the_host_cannot_be_captured():
    """torch's Adam on a CPU reads its step count on the host at every step (capturable=True
    is for CUDA): its capture fails, named."""
    model, _ = build("dense", 8, FORWARD, BACKWARD, kernels="torch")
    step = CapturedStep(model, loss_fn, optimizer("adam", model), *data("dense", 4))
    emulated(step)
    pairs = batches("dense", 3)
    for x, y in pairs[:2]:
        step.step(x, y)
    with pytest.raises(CaptureError, match="capturing the training step failed.*"
                                           "_local_scalar_dense"):
        step.step(*pairs[2])


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_adam_with_its_step_counts_on_the_device_replays_the_eager_steps_numbers(kind):
    """Adam as a captured run on a GPU builds it (capturable=True: step counts and bias
    corrections on the device): six steps, the last three replays of the recorded update,
    losses, residual histories and parameters bit for bit those of eager steps with the
    same optimizer, and the step counts moved by the replays."""
    with step_counts_on_the_device():
        _, opt = six_steps_as_eager(kind, (FORWARD, BACKWARD), "device adam")
    assert {state["step"].item() for state in opt.state.values()} == {6.0}


@pytest.mark.parametrize("mode", ["training", "evaluation"])
def test_forward_passes_replayed_without_python_give_the_eager_outputs(mode):
    """Training mode (two MGRIT cycles, warm-started) and evaluation mode with MGRIT
    inference options: outputs and histories bit for bit through three replays."""
    inference = mgrit.Config(levels=3, coarsening=2, tol=0.0, max_iter=2, min_coarse=1)

    def make():
        model, _ = build("dense", 8, WARM, BACKWARD, kernels="torch", inference=inference)
        return model.train(mode == "training")

    inputs = [x for x, _ in batches("dense", 6)]
    model = make()
    expected = []
    for x in inputs:
        with torch.no_grad():
            expected.append((model(x), model.stats["forward"]["residuals"]))
    model = make()
    forward = CapturedForward(model, inputs[0])
    capturer = emulated(forward)
    for x, (out, history) in zip(inputs, expected):
        assert torch.equal(forward(x), out)
        assert forward.stats()["forward"]["residuals"] == history
    assert (capturer.warm_ups, capturer.captured, capturer.replays) == (2, 1, 3)


def test_a_replayed_step_and_a_replayed_forward_pass_take_turns():
    """The step's replays update the parameters in place and the pass's replays read them:
    the numbers of eager steps and passes taking the same turns."""
    pairs = batches("dense", 6)
    model, _ = build("dense", 8, FORWARD, BACKWARD, kernels="torch")
    opt = optimizer("sgd", model)
    expected = []
    for x, y in pairs:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        with torch.no_grad():
            expected.append(model(x))
    model, _ = build("dense", 8, FORWARD, BACKWARD, kernels="torch")
    step = CapturedStep(model, loss_fn, optimizer("sgd", model), *pairs[0])
    forward = CapturedForward(model, pairs[0][0])
    captures = emulated(step), emulated(forward)
    for k, (x, y) in enumerate(pairs):
        step.step(x, y)
        assert torch.equal(forward(x), expected[k])
    assert [c.replays for c in captures] == [3, 3]


@pytest.mark.parametrize("opt", ["sgd", "device adam"])
def test_a_transformer_stack_replays_with_the_eager_numbers(opt):
    """TransformerBlock (batched step, causal attention): five steps of SGD with momentum
    and of Adam as a GPU run builds it, losses and parameters equal to eager training's
    with the same optimizer to the bit."""
    with step_counts_on_the_device():
        make, pairs, losses, eager = transformer_case(5, opt, kernels="torch")
        model, optim = make()
        step = CapturedStep(model, nn.functional.mse_loss, optim, *pairs[0])
        capturer = emulated(step)
        assert [step.step(x, y).item() for x, y in pairs] == losses
    assert capturer.replays == 2
    assert all(torch.equal(a, b) for a, b in zip(eager, model.parameters()))


@pytest.mark.parametrize("layers,every", [(8, 2), (16, 1), (16, 3)])
def test_a_controllers_probes_between_replays_measure_and_leave_training_as_it_was(
        layers, every):
    """A controller probing between replays (eagerly, on solvers of its own, the gradients
    put back afterwards): training has the numbers of eager training without a controller,
    and each probe measured the error of a model loaded with the weights the replays
    wrote. A 16-layer stack's adjoint reads its weights in descending order through a
    gathered copy, cached while their version counters stand still, which a replay leaves
    as they were (as a CUDA graph's does) while its update changes the weights: a probe
    after a replay must gather again, and the capture after a probe (every step) must
    gather in the graph, not read the probe's copy."""
    losses, params, _ = eager_run("dense", "sgd", FORWARD, BACKWARD, 7, kernels="torch",
                                  layers=layers)
    model, _ = build("dense", layers, FORWARD, BACKWARD, kernels="torch")
    controller = mgrit.nn.Controller(model, calibration=STEADY, every=every,
                                     max_every=every, warm_trials=False, hierarchies=False)
    step = CapturedStep(model, loss_fn, optimizer("sgd", model), *data("dense", 4),
                        controller=controller)
    capturer = emulated(step)
    for k, (x, y) in enumerate(batches("dense", 7)):
        assert step.step(x, y).item() == losses[k], k
        if controller.probes[-1]["step"] == k:
            expected = probed_error(model, (FORWARD, BACKWARD), x, y, kernels="torch")
            assert expected > 1e-6
            assert controller.probes[-1]["error"] == pytest.approx(expected, rel=1e-9), k
    assert capturer.replays == 4 and not controller.decisions
    assert [p["step"] for p in controller.probes] == list(range(0, 7, every))
    # to round-off: the eager adjoint takes a lone non-zero row as a single product, the
    # captured one the whole batch (`round_off_equal`)
    assert all(round_off_equal(a.detach(), b.detach())
               for a, b in zip(params, model.parameters()))


# sweep graphs (Config.cuda_graphs): the relaxation sweeps between a rank's messages --------

def _train_with_sweep_graphs(graphs, comm=None, steps=4):
    cfg = dict(levels=3, coarsening=2, min_coarse=1, relax=("F", "FCF"), tol=0.0)
    model, _ = build("dense", 16, mgrit.Config(max_iter=2, cuda_graphs=graphs, **cfg),
                     mgrit.Config(max_iter=1, cuda_graphs=graphs, **cfg), comm=comm,
                     kernels="torch")
    opt = optimizer("sgd", model)
    outs = [torch.tensor(train_eagerly(model, opt, loss_fn, batches("dense", steps)))]
    model.eval()
    with torch.no_grad():
        outs.append(model(batches("dense", 1)[0][0]))
    graphs_of = [s.executor.graphs for s in model._passes.forward_solvers.values()
                 if s.executor.graphs is not None]
    return outs, (sum(g.captured for g in graphs_of), sum(g.replayed for g in graphs_of))


@pytest.mark.parametrize("ranks", [1, 2])
def test_sweep_graphs_replayed_without_python_give_the_replays_that_rerun_it(
        monkeypatch, ranks):
    """Training and an evaluation pass with every relaxation sweep captured (on one rank,
    and between the messages of two virtual ranks): sweeps replayed as their recorded
    operations alone give the numbers of sweeps replayed by running them again, to the
    bit, and those of training without graphs to round-off (without graphs the phases run
    as planned loops, a different order of the same operations)."""
    from mgrit.comm.virtual import run_ranks
    from mgrit.execute import SweepGraphs
    from mgrit.execute import graphs as graph_module
    from test_graphs import _Capture

    monkeypatch.setattr(SweepGraphs, "device_types", ("cpu",))
    # each virtual rank (a thread) makes the stand-ins of its own run
    chosen = threading.local()
    monkeypatch.setattr(graph_module, "CudaCapture", lambda: chosen.capture())

    def program(comm):
        runs = {}
        for name, capture in (("emulated", EmulatedCapture), ("rerun", lambda: _Capture([]))):
            chosen.capture = capture
            runs[name] = _train_with_sweep_graphs(True, comm)
        without, none = _train_with_sweep_graphs(False, comm)
        (emulated, counts), (rerun, _) = runs["emulated"], runs["rerun"]
        return ([torch.equal(a, b) for a, b in zip(emulated, rerun)],
                max(float((a - b).abs().max() / b.abs().max())
                    for a, b in zip(emulated, without)), counts, none)

    results = [program(None)] if ranks == 1 else run_ranks(ranks, program)
    for equal, error, (captured, replayed), none in results:
        assert equal == [True, True] and error <= 1e-12 and none == (0, 0)
        assert captured >= 2 and replayed > captured
