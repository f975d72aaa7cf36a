"""The captured forward pass (`mgrit.nn.CapturedForward`) on the CPU: the eager pass's
outputs and residual histories to the bit in training and evaluation mode, the same storage
every pass, no host read inside a pass, a capture started again whenever the solvers, the
mode or the options change, and a clear refusal of what a CUDA graph cannot hold. The CUDA
graph is replaced by the stand-in of test_capture, which replays by running the pass again,
which is what a graph's replay computes."""

import pytest
import torch
from torch import nn

import mgrit
from mgrit.comm.virtual import run_ranks
from mgrit.nn import CapturedForward, CapturedStep, CaptureError
from mgrit.nn.capture_guard import HostSyncError

from nets import build, data, loss_fn, optimizer
from test_capture import BACKWARD, FORWARD, WARM, batches, stand_in

MGRIT_INFERENCE = mgrit.Config(levels=3, coarsening=2, tol=0.0, max_iter=2, min_coarse=1,
                               relax="FCF")
# (training mode, forward options, inference options)
MODES = {"training": (True, FORWARD, None), "training, warm": (True, WARM, None),
         "evaluation, exact": (False, FORWARD, None),
         "evaluation, mgrit": (False, FORWARD, MGRIT_INFERENCE)}


def make(kind, mode, comm=None):
    training, forward, inference = MODES[mode]
    model, serial = build(kind, 8, forward, BACKWARD, comm=comm, inference=inference)
    return model.train(training), serial


def eager_passes(model, inputs):
    """Outputs and forward residual histories of plain no-grad forward passes."""
    outputs, histories = [], []
    for x in inputs:
        with torch.no_grad():
            outputs.append(model(x))
        histories.append(model.stats["forward"]["residuals"])
    return outputs, histories


@pytest.mark.parametrize("kind", ["dense", "gelu", "conv"])
@pytest.mark.parametrize("mode", list(MODES))
def test_captured_forward_gives_the_eager_passes_numbers_to_the_bit(kind, mode):
    """Five passes: outputs and residual histories (the device tensor against the eager
    list) bit for bit, through the stand-in graph's capture and replays; in evaluation
    mode with exact stepping also serial PyTorch's output (levels=1 is the network)."""
    inputs = [x for x, _ in batches(kind, 5)]
    outputs, histories = eager_passes(make(kind, mode)[0], inputs)
    model, serial = make(kind, mode)
    captured = CapturedForward(model, inputs[0])
    capturer = stand_in(captured)
    for k, x in enumerate(inputs):
        out = captured(x)
        assert torch.equal(out, outputs[k])
        history = captured.history()["forward"]
        assert history.dtype == torch.float64 and history.tolist() == histories[k]
    assert (capturer.warm_ups, capturer.captured, capturer.replays) == (2, 1, 3)
    assert not any(p.grad is not None for p in model.parameters())
    if mode == "evaluation, exact":
        with torch.no_grad():
            assert torch.allclose(out, serial(inputs[-1]), rtol=1e-13, atol=1e-15)


def test_the_output_and_the_solvers_storage_stay_where_they_are():
    model, _ = make("dense", "training")
    inputs = [x for x, _ in batches("dense", 5)]
    captured = CapturedForward(model, inputs[0])

    def storage():
        solvers = model._passes.forward_solvers
        rows = {key[:4]: [level.u.data_ptr() for level in s.levels]
                for key, s in solvers.items()}
        return (captured.output.data_ptr(), captured.history()["forward"].data_ptr(),
                captured.inputs[0].data_ptr(), rows)

    captured(inputs[0])
    first = storage()
    for x in inputs[1:]:
        captured(x)
        assert storage() == first


def test_no_host_read_inside_a_pass_and_the_guard_is_live():
    inputs = [x for x, _ in batches("dense", 4)]
    outputs, _ = eager_passes(make("dense", "evaluation, mgrit")[0], inputs)
    model, _ = make("dense", "evaluation, mgrit")
    captured = CapturedForward(model, inputs[0], check=False)
    captured(inputs[0])         # builds the solvers
    for k, x in enumerate(inputs[1:], start=1):
        with captured.guarded():
            out = captured(x)
            with pytest.raises(HostSyncError):
                out.sum().item()
        captured.check()
        assert torch.equal(out, outputs[k])


def test_training_between_passes_is_what_the_next_pass_reads():
    """Three passes, then a captured step and a captured forward pass on one model taking
    turns (the step updates the parameters in place, the pass's graph reads them): the
    numbers of eager passes and steps in the same order. Making the step rebuilds the
    training solvers, the pass's among them: the pass warms up and captures again rather
    than replay a graph of storage since given away."""
    pairs = batches("dense", 4)
    x0 = pairs[0][0]

    def run(captured):
        model, _ = make("dense", "training")
        opt = optimizer("adam", model)
        forward = CapturedForward(model, x0) if captured else None
        counts = []

        def fwd(x):
            if forward is None:
                with torch.no_grad():
                    return model(x)
            out = forward(x).clone()
            counts.append((capturer.warm_ups, capturer.captured, capturer.replays))
            return out
        if forward is not None:
            capturer = stand_in(forward)
        outs = [fwd(x0) for _ in range(3)]
        step = CapturedStep(model, loss_fn, opt, *pairs[0]) if captured else None
        for x, y in pairs:
            if step is None:
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
            else:
                step.step(x, y)
            outs.append(fwd(x))
        return outs, counts

    expected, _ = run(captured=False)
    outs, counts = run(captured=True)
    assert all(torch.equal(a, b) for a, b in zip(outs, expected))
    assert counts == [(1, 0, 0), (2, 0, 0), (2, 1, 1),
                      (3, 1, 1), (4, 1, 1), (4, 2, 2), (4, 2, 3)]


def test_a_new_mode_options_or_solvers_start_the_stages_again():
    """Evaluation after training mode, set_solvers' new options, and the same options set
    again (which builds new solvers) each warm up and capture again; every pass has the
    numbers of eager passes in the same order."""
    more = mgrit.Config(levels=2, coarsening=4, tol=0.0, max_iter=3, min_coarse=1)
    x = batches("dense", 1)[0][0]
    changes = {3: lambda m: m.eval(), 6: lambda m: m.train().set_solvers(forward=more),
               9: lambda m: m.set_solvers(forward=more)}

    def run(captured):
        model, _ = make("dense", "training")
        forward = CapturedForward(model, x) if captured else None
        capturer = stand_in(forward) if captured else None
        outs = []
        for k in range(12):
            if k in changes:
                changes[k](model)
            if forward is None:
                with torch.no_grad():
                    outs.append(model(x))
            else:
                outs.append(forward(x).clone())
        return outs, capturer

    expected, _ = run(captured=False)
    outs, capturer = run(captured=True)
    assert all(torch.equal(a, b) for a, b in zip(outs, expected))
    assert (capturer.warm_ups, capturer.captured, capturer.replays) == (8, 4, 4)


def test_what_cannot_be_captured_is_refused():
    x = batches("dense", 1)[0][0]
    model, _ = build("dense", 8, mgrit.Config(levels=2, tol=1e-6, max_iter=5), BACKWARD)
    with pytest.raises(CaptureError, match=r"forward solve has tol=1e-06.*use tol=0.*"
                                           r"read after the forward pass"):
        CapturedForward(model, x)
    # evaluation solves with the inference options: exact stepping by default
    model.eval()
    CapturedForward(model, x)
    model, _ = build("dense", 8, FORWARD, BACKWARD,
                     inference=mgrit.Config(levels=2, tol=1e-9, max_iter=9))
    model.eval()
    with pytest.raises(CaptureError, match="forward solve has tol=1e-09"):
        CapturedForward(model, x)
    model, _ = make("dense", "training")
    captured = CapturedForward(model, x)
    with pytest.raises(CaptureError, match=r"input has shape \(6, 5\).*this forward pass was "
                                           r"built for shape \(4, 5\).*another CapturedForward"):
        captured(data("dense", 6)[0])
    with pytest.raises(CaptureError, match="cannot run inside model.probing"):
        with model.probing(FORWARD, BACKWARD):
            captured(x)
    torch.manual_seed(0)
    dropout = mgrit.LayerParallel(lambda: nn.Sequential(nn.Linear(5, 5), mgrit.nn.Dropout(0.1)),
                                  8, forward=FORWARD, backward=BACKWARD).double()
    with pytest.raises(CaptureError, match="draws random numbers.*without CapturedForward"):
        CapturedForward(dropout, x)
    # in evaluation mode dropout draws nothing
    dropout.eval()
    with torch.no_grad():
        expected = dropout(x)
    assert torch.equal(CapturedForward(dropout, x)(x), expected)


def test_a_divergent_residual_raises_after_the_pass_and_close_gives_the_model_back():
    model, _ = make("dense", "training")
    x = batches("dense", 1)[0][0]
    captured = CapturedForward(model, x)
    captured(x)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(mgrit.DivergenceError, match=r"residual nan after cycle 1") as err:
        captured(bad)
    assert any("forward solve of a captured forward pass" in n for n in err.value.__notes__)
    captured.close()
    with torch.no_grad():
        model(x)
    assert isinstance(model.stats["forward"]["residuals"], list)
    model.set_solvers(forward=mgrit.Config(levels=2, tol=1e-8, max_iter=4))
    with torch.no_grad():
        model(x)


def test_on_two_ranks_the_captured_forward_gives_the_eager_passes_numbers():
    """Two virtual ranks (unequal shares of 7 layers), in training mode and in evaluation
    mode with MGRIT: every rank's outputs and histories are the eager pass's to the bit."""
    inputs = [x for x, _ in batches("dense", 4)]

    def program(comm):
        results = []
        for mode in ("training", "evaluation, mgrit"):
            training, forward, inference = MODES[mode]
            eager, _ = build("dense", 7, forward, BACKWARD, comm=comm, inference=inference)
            outputs, histories = eager_passes(eager.train(training), inputs)
            model, _ = build("dense", 7, forward, BACKWARD, comm=comm, inference=inference)
            captured = CapturedForward(model.train(training), inputs[0])
            for k, x in enumerate(inputs):
                results.append(torch.equal(captured(x), outputs[k])
                               and captured.stats()["forward"]["residuals"] == histories[k])
        return results
    assert run_ranks(2, program) == [[True] * 8] * 2


# run by `pytest -m gpu` (benchmarks/gpu_check.sh), skipped without a CUDA device
needs_gpu = pytest.mark.gpu


@needs_gpu
@pytest.mark.parametrize("mode", ["training", "evaluation, mgrit"])
def test_on_cuda_the_pass_is_one_graph_with_the_eager_passes_numbers(mode):
    """On one CUDA device the third pass is captured once and every later pass replays
    it; outputs and histories match the eager CUDA pass (float64, to 1e-12)."""
    inputs = [data("dense", 4, seed=k)[0].cuda() for k in range(6)]
    outputs, histories = eager_passes(make("dense", mode)[0].cuda(), inputs)
    model = make("dense", mode)[0].cuda()
    captured = CapturedForward(model, inputs[0])
    for k, x in enumerate(inputs):
        assert torch.allclose(captured(x), outputs[k], rtol=1e-12, atol=1e-14)
        assert captured.stats()["forward"]["residuals"] == pytest.approx(histories[k],
                                                                          rel=1e-10)
    assert captured.captures == 1 and captured._graph is not None
