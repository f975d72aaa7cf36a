"""Captured steps and forward passes on several ranks: graphs between the messages. Each
virtual rank's run is captured as graphs of its tensor work cut at every communicator call
(`mgrit.comm.cuts`), the calls kept as host steps, and replayed as graphs and host steps in
order (`mgrit.execute.Segmented`). The graphs are emulated (`emulated_graphs`: recorded
aten operations replayed alone, no Python of the step), so numbers equal to eager training
on the same ranks show that the replays' messages carry what the step's own would."""

import contextlib
import re
import threading
import warnings

import pytest
import torch
from torch import nn

import mgrit
from mgrit.comm.cuts import CutComm, CutError, Cuts, Running
from mgrit.comm.virtual import run_ranks
from mgrit.execute.graphs import Segmented, capture_between
from mgrit.nn import CapturedForward, CapturedStep, CaptureError

from emulated_graphs import EmulatedCapture, EmulatedGraph, step_counts_on_the_device
from nets import (CLASSES, WIDTH, build, data, loss_fn, optimizer, round_off_equal,
                  train_eagerly)
from test_capture import (BACKWARD, FORWARD, WARM, batches, eager_run, on_another_thread,
                          stand_in, transformer_case)
from test_capture_replay import NESTED

# gathered coarse levels: fetched to every rank by reductions before each solve
GATHERED = mgrit.Config(levels=3, coarsening=2, tol=0.0, max_iter=2, min_coarse=1,
                        agglomerate=1)
GATHERED_WARM = mgrit.Config(levels=3, coarsening=2, tol=0.0, max_iter=1, min_coarse=1,
                             agglomerate=2, initial_guess="warm")
CONFIGS = {"zero": (FORWARD, BACKWARD), "warm": (WARM, WARM), "no cycle": (NESTED, NESTED),
           "gathered": (GATHERED, GATHERED), "gathered, warm": (GATHERED_WARM, GATHERED_WARM)}


def replayed_steps(kind, configs, comm, steps=6, opt="sgd"):
    """Losses, parameters, histories and the capturer of `steps` captured steps whose
    graphs are emulated."""
    model, _ = build(kind, 8, *configs, comm=comm, kernels="torch")
    step = CapturedStep(model, loss_fn, optimizer(opt, model), *data(kind, 4))
    capturer = stand_in(step, EmulatedCapture())
    losses, histories = [], []
    for x, y in batches(kind, steps):
        losses.append(step.step(x, y).item())
        histories.append({p: step.stats()[p]["residuals"] for p in ("forward", "backward")})
    return losses, list(model.parameters()), histories, capturer


def against_eager(kind, configs, comm, opt="sgd"):
    """On one virtual rank: whether six captured steps' losses, residual histories and
    parameters equal eager training's on the same ranks, to round-off; the warm-ups,
    captures and replays; whether the program has graphs and host steps."""
    eager = eager_run(kind, opt, *CONFIGS[configs], 6, kernels="torch", comm=comm)
    losses, params, histories, capturer = replayed_steps(kind, CONFIGS[configs], comm,
                                                         opt=opt)
    program, = capturer.programs
    return (round_off_equal(losses, eager[0]),
            all(round_off_equal(h[p], e[p]) for h, e in zip(histories, eager[2])
                for p in ("forward", "backward")),
            all(round_off_equal(a.detach(), b.detach()) for a, b in zip(params, eager[1])),
            (capturer.warm_ups, capturer.captured, capturer.replays),
            program.graphs > 0 and program.host_steps > 0)


EQUAL = (True, True, True, (2, 1, 3), True)


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("kind", ["dense", "conv"])
@pytest.mark.parametrize("configs", list(CONFIGS))
def test_steps_replayed_between_messages_give_the_eager_steps_numbers(ranks, kind, configs):
    """Six SGD-momentum steps on 2 and 3 virtual ranks, the last three replays of graphs
    and host steps: every rank's losses, residual histories and parameters are those of
    eager training on the same ranks, to round-off (`round_off_equal`; bit for bit where
    the CPU's batched and single products round alike); coarse levels gathered on every
    rank included (their fetches are reductions, host steps like the messages)."""
    assert run_ranks(ranks, lambda comm: against_eager(kind, configs, comm)) == [EQUAL] * ranks


@pytest.mark.parametrize("configs", ["zero", "gathered, warm"])
def test_adam_with_its_step_counts_on_the_device_replays_between_messages(configs):
    """Adam as a captured run on a GPU builds it (capturable=True), on 2 virtual ranks: six
    steps, the last three replays, every rank's losses, histories and parameters those of
    eager steps with the same optimizer, bit for bit."""
    with step_counts_on_the_device():
        assert run_ranks(2, lambda comm: against_eager("dense", configs, comm,
                                                       "device adam")) == [EQUAL] * 2


@pytest.mark.parametrize("opt", ["sgd", "device adam"])
def test_a_transformer_stack_replays_between_messages_with_the_eager_numbers(opt):
    """TransformerBlock layers (batched step, causal attention) on 2 virtual ranks: five
    steps of SGD with momentum and of Adam as a GPU run builds it, the last two replays,
    every rank's losses and parameters those of eager training on the same ranks with the
    same optimizer, bit for bit."""
    def program(comm):
        make, pairs, losses, eager = transformer_case(5, opt, kernels="torch", comm=comm)
        model, optim = make()
        step = CapturedStep(model, nn.functional.mse_loss, optim, *pairs[0])
        capturer = stand_in(step, EmulatedCapture())
        return ([step.step(x, y).item() for x, y in pairs] == losses, capturer.replays,
                all(torch.equal(a, b) for a, b in zip(eager, model.parameters())))
    with step_counts_on_the_device():
        assert run_ranks(2, program) == [(True, 2, True)] * 2


def test_replays_without_their_messages_train_differently():
    """Not vacuous: replays that run the graphs alone (the host steps dropped) leave each
    rank's ghost rows and ghost layers as the capture received them, and rank 1 then
    trains differently from eager training."""
    def program(comm):
        eager = eager_run("dense", "sgd", FORWARD, BACKWARD, 6, kernels="torch", comm=comm)
        original = Segmented.replay

        def graphs_only(self):
            self.steps = [s for s in self.steps
                          if isinstance(getattr(s, "__self__", None), EmulatedGraph)]
            original(self)

        Segmented.replay = graphs_only
        try:
            losses = replayed_steps("dense", (FORWARD, BACKWARD), comm)[0]
        finally:
            Segmented.replay = original
        return losses[:3] == eager[0][:3], losses[3:] == eager[0][3:]
    rank0, rank1 = run_ranks(2, program)
    assert rank0[0] and rank1[0]
    assert not rank1[1]


def test_replicas_average_their_gradients_between_graphs():
    """Two data-parallel replicas of one layer rank, each on batches of its own: the
    gradients' average over the replicas is a host step of the replay, and both replicas
    train as eager data-parallel training does, to the bit (the same parameters on both,
    which they would not be without the average)."""
    def program(data_comm):
        def train(captured):
            model, _ = build("dense", 8, FORWARD, BACKWARD, data_comm=data_comm,
                             kernels="torch")
            opt = optimizer("sgd", model)
            pairs = batches("dense", 12)[data_comm.rank::2]
            if captured:
                step = CapturedStep(model, loss_fn, opt, *pairs[0])
                capturer = stand_in(step, EmulatedCapture())
                losses = [step.step(x, y).item() for x, y in pairs]
                return losses, list(model.parameters()), capturer
            return train_eagerly(model, opt, loss_fn, pairs), list(model.parameters()), None

        (losses, params, capturer), (eager_losses, eager_params, _) = train(True), train(False)
        program, = capturer.programs
        return (losses == eager_losses,
                all(torch.equal(a, b) for a, b in zip(params, eager_params)),
                capturer.replays, program.host_steps, [p.detach() for p in params])
    first, second = run_ranks(2, program)
    assert first[:4] == second[:4] == (True, True, 3, 1)
    assert all(torch.equal(a, b) for a, b in zip(first[4], second[4]))


@pytest.mark.parametrize("mode", ["training", "evaluation, mgrit", "evaluation, exact"])
def test_forward_passes_replayed_between_messages_give_the_eager_outputs(mode):
    """A forward pass without gradients on 2 virtual ranks (7 layers, unequal shares):
    outputs and residual histories of the eager passes, bit for bit, through three
    replays (in evaluation mode with exact stepping the state passes from rank to rank);
    the output reached every rank by a replayed broadcast."""
    inference = (mgrit.Config(levels=3, coarsening=2, tol=0.0, max_iter=2, min_coarse=1)
                 if mode == "evaluation, mgrit" else None)
    inputs = [x for x, _ in batches("dense", 6)]

    def program(comm):
        def make():
            model, _ = build("dense", 7, FORWARD, BACKWARD, comm=comm, kernels="torch",
                             inference=inference)
            return model.train(mode == "training")

        eager, expected = make(), []
        for x in inputs:
            with torch.no_grad():
                expected.append((eager(x), eager.stats["forward"]["residuals"]))
        forward = CapturedForward(make(), inputs[0])
        capturer = stand_in(forward, EmulatedCapture())
        same = [torch.equal(forward(x), out)
                and forward.stats()["forward"]["residuals"] == history
                for x, (out, history) in zip(inputs, expected)]
        return same, capturer.replays, capturer.programs[0].host_steps > 0
    assert run_ranks(2, program) == [([True] * 6, 3, True)] * 2


class _Summing(nn.Linear):
    """A closing that asks the other ranks for a host number every pass."""

    comm = None

    def forward(self, x):
        return super().forward(x) * self.comm.allreduce_sum(1.0)


class _Posting(nn.Linear):
    """A closing that sends its output to the next rank and never completes the send."""

    comm = None

    def forward(self, x):
        out = super().forward(x)
        if self.comm.rank == 0:
            self.comm.isend(out.detach().contiguous(), 1, 99)
        return out


@pytest.mark.parametrize("closing, matches", [
    (_Summing, [r"allreduce_sum returns a float to the host.*sums tensors"] * 2),
    (_Posting, [r"1 message\(s\) posted in the captured run were not completed in it "
                r"\(first: a send to rank 1, tag 99\)",
                r"another rank's run posted a message it did not complete"]),
])
def test_what_a_replay_cannot_repeat_is_refused_before_the_capture(closing, matches):
    """Checked in the guarded second step, before anything is captured, and refused on
    every rank as a CaptureError: a host number from the communicator, and a message that
    the step posts and never completes (named on the rank that posts it)."""
    def program(comm):
        model, _ = build("dense", 8, FORWARD, BACKWARD, comm=comm, kernels="torch")
        model.closing = closing(WIDTH, CLASSES).double()
        model.closing.comm = model.comm
        step = CapturedStep(model, loss_fn, optimizer("sgd", model), *data("dense", 4))
        capturer = stand_in(step, EmulatedCapture())
        x, y = data("dense", 4)
        step.step(x, y)
        with pytest.raises(CaptureError) as raised:
            step.step(x, y)
        assert re.search(r"on several ranks runs its messages between graphs, and this one "
                         r"cannot: " + matches[comm.rank], str(raised.value)), raised.value
        return capturer.captured, model.comm.cuts.session
    assert run_ranks(2, program) == [(0, None)] * 2


def test_a_capture_between_messages_keeps_them_in_order_and_drops_empty_graphs():
    """The session logic on its own: graphs end at every call, a graph with no work is
    dropped, the calls are replayed between the graphs in the run's order (but a check of
    host values, which cuts as well, is not), the capture's own run is the first replay; a
    failing run ends the capture and lets the cuts go."""
    log, cuts, made = [], Cuts(), []
    comm = CutComm(_Recorder(log), cuts)
    pending = {"work": False}

    def begin():
        pending["work"] = False

    def end():
        if not pending["work"]:
            return None
        made.append(len(made))
        name = f"graph {made[-1]}"

        class Graph:
            def replay(self):
                log.append(name)
        return Graph()

    def run():
        pending["work"] = True
        request = comm.irecv(torch.zeros(1), 1, 0)      # two calls with nothing between
        comm.allreduce_sum_(torch.zeros(1))
        pending["work"] = True
        request.wait()
        pending["work"] = True
        comm.agree("settings", 1)       # host values only: cuts, but is not replayed

    program = capture_between(cuts, run, begin, end)
    assert (program.graphs, program.host_steps) == (3, 3)
    assert log == ["irecv", "allreduce", "wait", "agree"] and cuts.session is None
    log.clear()
    program.replay()                # the capture's own run
    program.replay()
    assert log == ["graph 0", "irecv", "allreduce", "graph 1", "wait", "graph 2"]
    assert program.replays == 1

    def failing():
        comm.isend(torch.zeros(1), 1, 0)
        raise KeyError("inside the run")
    with pytest.raises(KeyError, match="inside the run"):
        capture_between(cuts, failing, begin, end)
    assert cuts.session is None
    log.clear()
    comm.allreduce_sum_(torch.zeros(1))         # outside a capture: straight through
    assert log == ["allreduce"]


def test_a_run_checked_without_capture_runs_its_calls_as_they_come():
    """`Running`: each call runs at once and nothing is kept; an incomplete message and a
    host number are still refused."""
    log, cuts = [], Cuts()
    comm = CutComm(_Recorder(log), cuts)
    cuts.begin(Running())
    comm.irecv(torch.zeros(1), 1, 0).wait()
    cuts.end()
    assert log == ["irecv", "wait"]
    cuts.begin(Running())
    with pytest.raises(CutError, match="allreduce_sum returns a float"):
        comm.allreduce_sum(2.0)
    comm.send_init(torch.zeros(1), 1, 5).start()
    with pytest.raises(CutError, match=r"first: a send to rank 1, tag 5"):
        cuts.end()
    assert cuts.session is None


class _Recorder:
    """A communicator that logs its calls."""

    rank, size = 0, 2

    def __init__(self, log):
        self.log = log

    def isend(self, buf, dest, tag):
        self.log.append("isend")
        return self

    def irecv(self, buf, source, tag):
        self.log.append("irecv")
        return self

    def wait(self):
        self.log.append("wait")

    def allreduce_sum_(self, buf):
        self.log.append("allreduce")

    def allreduce_sum(self, value):
        return value

    def agree(self, what, value):
        self.log.append("agree")


# autograd's override of stale capture streams, where torch has it (older releases have
# none, and `CudaCapture` then changes nothing): on inside a capture, off after
_OVERRIDE = getattr(torch._C, "_override_stale_capture_stream", None)
_OVERRIDING = True if _OVERRIDE is not None else None


def _overridden():
    return None if _OVERRIDE is None else _OVERRIDE()


def _faked_cuda(monkeypatch):
    """(log, faked `torch.cuda`, cuts, a cut communicator logging its calls, a tensor)."""
    log = []
    fake = _FakeCuda(log)
    monkeypatch.setattr(torch, "cuda", fake)
    cuts = Cuts()
    return log, fake, cuts, CutComm(_Recorder(log), cuts), torch.zeros(1)


class _FakeCuda:
    """The parts of `torch.cuda` that a capture between messages calls, logging them: a
    graph that captures nothing warns as CUDA's does, and one begun in a mode other than
    relaxed cannot end on another thread, as CUDA's cannot."""

    def __init__(self, log):
        self.log = log
        self.work = False
        self.invalidated = False
        fake = self

        class Graph:
            made = 0

            def __init__(self):
                Graph.made += 1
                self.name = f"g{Graph.made}"

            def capture_begin(self, pool=None, capture_error_mode="global"):
                fake.work = False
                self.thread, self.mode = threading.get_ident(), capture_error_mode
                fake.log.append(("begin", self.name, pool))

            def capture_end(self):
                if self.mode != "relaxed" and threading.get_ident() != self.thread:
                    raise RuntimeError("CUDA error: cudaErrorStreamCaptureWrongThread")
                if fake.invalidated:
                    raise RuntimeError("CUDA error: operation failed due to a previous "
                                       "error during capture")
                fake.log.append(("end", self.name))
                if not fake.work:
                    warnings.warn("The CUDA Graph is empty. This usually means ...")

            def replay(self):
                fake.log.append(("replay", self.name))

        self.CUDAGraph = Graph

    def graph_pool_handle(self):
        return "pool"

    def synchronize(self):
        self.log.append(("synchronize",))

    def empty_cache(self):
        pass

    def Stream(self, device):
        return _FakeStream("side", self.log)

    def current_stream(self, device):
        return _FakeStream("caller", self.log)

    @contextlib.contextmanager
    def stream(self, stream):
        self.log.append(("on", stream.name))
        try:
            yield
        finally:                    # as torch's stream context, whatever happened inside
            self.log.append(("off", stream.name))



class _FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))


def test_cuda_capture_between_messages_makes_the_calls_in_order(monkeypatch):
    """`CudaCapture` on several ranks, with `torch.cuda` faked (no GPU here): on the side
    stream after the caller's work, each graph from the one pool, ended and run at every
    message before the message runs, a graph with no work dropped (and its warning not
    shown), a failing run's capture ended without running it; autograd's override of
    stale streams on while capturing and restored after."""
    from mgrit.execute import CudaCapture

    log, fake, cuts, comm, like = _faked_cuda(monkeypatch)

    overridden = []

    def run():
        overridden.append(_overridden())
        fake.work = True
        request = comm.irecv(like, 1, 0)
        comm.allreduce_sum_(like)           # nothing between: an empty graph, dropped
        fake.work = True
        request.wait()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        program = CudaCapture().capture(like, run, cuts)
    assert not seen
    assert log == [("synchronize",), ("wait", "side", "caller"), ("on", "side"),
                   ("begin", "g1", "pool"), ("end", "g1"), ("replay", "g1"), "irecv",
                   ("begin", "g2", "pool"), ("end", "g2"), "allreduce",
                   ("begin", "g3", "pool"), ("end", "g3"), ("replay", "g3"), "wait",
                   ("begin", "g4", "pool"), ("end", "g4"),
                   ("off", "side"), ("wait", "caller", "side")]
    assert (program.graphs, program.host_steps) == (2, 3)
    log.clear()
    program.replay()
    program.replay()
    assert log == [("replay", "g1"), "irecv", "allreduce", ("replay", "g3"), "wait"]

    log.clear()

    def failing():
        fake.work = True
        raise KeyError("inside the run")
    with pytest.raises(KeyError, match="inside the run"):
        CudaCapture().capture(like, failing, cuts)
    assert ("end", "g5") in log and ("replay", "g5") not in log and cuts.session is None
    # autograd's stale streams go to the capturing stream while capturing, and only then
    assert overridden == [_OVERRIDING] and not _overridden()


def test_a_capture_between_messages_may_cut_on_autograd_s_thread(monkeypatch):
    """A training step's adjoint sends from inside loss.backward(), on autograd's device
    thread: the graph begun on the caller's thread ends on that one, and the one begun
    there ends back on the caller's, which CUDA allows of a relaxed capture alone."""
    from mgrit.execute import CudaCapture

    log, fake, cuts, comm, like = _faked_cuda(monkeypatch)

    def backward():
        fake.work = True
        request = comm.irecv(like, 1, 0)
        fake.work = True
        request.wait()
        fake.work = True

    def run():
        fake.work = True
        on_another_thread(backward)

    program = CudaCapture().capture(like, run, cuts)
    assert (program.graphs, program.host_steps) == (3, 2)
    program.replay()
    log.clear()
    program.replay()
    assert log == [("replay", "g1"), "irecv", ("replay", "g2"), "wait", ("replay", "g3")]
    # the fake holds CUDA's rule: a capture in the default mode cannot end elsewhere
    graph = fake.CUDAGraph()
    graph.capture_begin()
    with pytest.raises(RuntimeError, match="WrongThread"):
        on_another_thread(graph.capture_end)


def test_one_graph_is_captured_with_stale_streams_overridden_too(monkeypatch):
    """One rank (no cuts): `CudaCapture.capture` makes one graph on the side stream,
    autograd's override of stale streams on while the run is captured. A run that fails
    ends the capture and raises its own error, not the one of ending a capture it
    invalidated, and gives the caller its stream back."""
    from mgrit.execute import CudaCapture

    log, overridden = [], []
    fake = _FakeCuda(log)
    monkeypatch.setattr(torch, "cuda", fake)

    def run():
        fake.work = True
        overridden.append(_overridden())
    graph = CudaCapture().capture(torch.zeros(1), run)
    assert log == [("synchronize",), ("on", "side"), ("begin", graph.name, None),
                   ("end", graph.name), ("off", "side")]
    assert overridden == [_OVERRIDING] and not _overridden()

    def failing():
        fake.invalidated = True     # as an operation CUDA cannot capture leaves it
        raise KeyError("inside the run")
    log.clear()
    with pytest.raises(KeyError, match="inside the run"):
        CudaCapture().capture(torch.zeros(1), failing)
    assert log[-2:] == [("begin", f"g{fake.CUDAGraph.made}", None), ("off", "side")]
    assert not _overridden()
