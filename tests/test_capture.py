"""The captured training step (`mgrit.nn.CapturedStep`) on the CPU: the eager step's numbers
to the bit, the same storage every step, no host read inside a step, and a clear refusal of
what a CUDA graph cannot hold. The CUDA graph itself is replaced by a stand-in that replays
by running the step again, which is what a graph's replay computes."""

import threading

import pytest
import torch
from torch import nn

import mgrit
from mgrit.core.cycle import Solver
from mgrit.nn import CapturedStep, CaptureError
from mgrit.nn.capture import _check_optimizer
from mgrit.nn.capture_guard import HostSyncError, host_reads_forbidden

from cases import resnet_problem
from nets import ForcedPolicy, build, data, loss_fn, optimizer, train_eagerly

FORWARD = mgrit.Config(levels=3, coarsening=2, tol=0.0, max_iter=2, min_coarse=1)
BACKWARD = mgrit.Config(levels=3, coarsening=2, tol=0.0, max_iter=1, min_coarse=1)
WARM = mgrit.Config(levels=2, coarsening=4, tol=0.0, max_iter=2, tol_kind="relative",
                    initial_guess="warm", relax="F")


def batches(kind, count):
    return [data(kind, 4, seed=k) for k in range(count)]


def eager_run(kind, opt_name, forward, backward, steps, change=None, kernels=None,
              comm=None, layers=8):
    """Losses, parameters and residual histories of plain eager training steps."""
    model, _ = build(kind, layers, forward, backward, kernels=kernels, comm=comm)
    histories = []

    def before(k):
        if change is not None and k == change[0]:
            model.set_solvers(*change[1])

    def after():
        histories.append({p: model.stats[p]["residuals"] for p in ("forward", "backward")})
    losses = train_eagerly(model, optimizer(opt_name, model), loss_fn, batches(kind, steps),
                           before, after)
    return losses, [p.detach().clone() for p in model.parameters()], histories


class _ReplayByRunning:
    """A CPU stand-in for CUDA capture: `capture` records the step and its graph's replay
    runs it, as a graph's replay computes what was captured."""

    def __init__(self):
        self.warm_ups = self.captured = self.replays = 0

    def warm_up(self, like, run):
        self.warm_ups += 1
        run()

    def capture(self, like, run, cuts=None):
        # on several ranks a replay that runs the step makes its messages itself
        stand_in = self

        class Graph:
            def replay(self):
                stand_in.replays += 1
                run()

        self.captured += 1
        return Graph()


def stand_in(captured, capture=None):
    """Make `captured` (a CapturedStep or CapturedForward) go through its stages as on one
    CUDA rank, with the CPU stand-in `capture` for CUDA capture (default: a
    `_ReplayByRunning`); returns the stand-in."""
    captured.graphs = True
    captured._capturer = capture if capture is not None else _ReplayByRunning()
    return captured._capturer


@pytest.mark.parametrize("kind", ["dense", "gelu", "conv"])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("configs", [(FORWARD, BACKWARD), (WARM, WARM)], ids=["zero", "warm"])
def test_captured_step_gives_the_eager_steps_numbers_to_the_bit(kind, opt_name, configs):
    """Same losses, parameters after 5 SGD-momentum or Adam steps, and residual histories
    (the device tensors against the eager lists), bit for bit: the same kernels run on the
    same values; the only differences are where values live (norms on the device, squared
    and summed in float64 either way) and all-zero cotangents being computed rather than
    skipped, which gives the same zeros."""
    steps = 5
    losses, params, histories = eager_run(kind, opt_name, *configs, steps)
    model, _ = build(kind, 8, *configs)
    step = CapturedStep(model, loss_fn, optimizer(opt_name, model), *data(kind, 4, seed=9))
    for k, (x, y) in enumerate(batches(kind, steps)):
        loss = step.step(x, y)
        assert loss.item() == losses[k]
        history = step.history()
        for kind_ in ("forward", "backward"):
            assert history[kind_].dtype == torch.float64
            assert history[kind_].tolist() == histories[k][kind_]
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


def test_the_steps_output_is_the_eager_steps_in_one_place():
    """`output` holds each step's model(x), as the eager step computes it, in the same
    tensor every step, through the capture and its replays (the CPU stand-in)."""
    eager, _ = build("dense", 8, FORWARD, BACKWARD)
    outputs = []

    def recording(out, y):
        outputs.append(out.detach().clone())
        return loss_fn(out, y)
    train_eagerly(eager, optimizer("sgd", eager), recording, batches("dense", 5))
    model, _ = build("dense", 8, FORWARD, BACKWARD)
    step = CapturedStep(model, loss_fn, optimizer("sgd", model), *data("dense", 4))
    replays = stand_in(step)
    held = []
    for k, (x, y) in enumerate(batches("dense", 5)):
        step.step(x, y)
        assert torch.equal(step.output, outputs[k])
        held.append(step.output.data_ptr())
    assert replays.replays == 3 and len(set(held)) == 1


def _storage(step):
    """data_ptr of everything a step must keep where it is."""
    model, opt = step.model, step.optimizer
    ptrs = {"input": step.inputs[0].data_ptr(), "target": step.inputs[1].data_ptr(),
            "loss": step.loss.data_ptr(), "output": step.output.data_ptr()}
    for i, p in enumerate(model.parameters()):
        ptrs[f"param {i}"] = p.data_ptr()
        ptrs[f"grad {i}"] = p.grad.data_ptr()
        for name, value in opt.state[p].items():
            if isinstance(value, torch.Tensor):
                ptrs[f"{name} {i}"] = value.data_ptr()
    passes = model._passes
    for kind, solvers in (("forward", passes.forward_solvers),
                          ("backward", passes.adjoint_solvers)):
        for key, solver in solvers.items():
            for level in solver.levels:
                for name in ("u", "v", "g"):
                    tensor = getattr(level, name, None)
                    if tensor is not None:
                        ptrs[f"{kind} {key[:2]} level {level.index} {name}"] = tensor.data_ptr()
    for kind, norms in step.history().items():
        ptrs[f"{kind} residuals"] = norms.data_ptr()
    return ptrs


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_states_gradients_optimizer_state_and_inputs_stay_where_they_are(opt_name):
    model, _ = build("dense", 8, FORWARD, BACKWARD)
    step = CapturedStep(model, loss_fn, optimizer(opt_name, model), *data("dense", 4))
    pairs = batches("dense", 6)
    step.step(*pairs[0])
    first = _storage(step)
    assert sum(name.startswith("grad") for name in first) == len(list(model.parameters()))
    assert any(name.startswith(("momentum_buffer", "exp_avg")) for name in first)
    assert any(" level " in name for name in first)
    for x, y in pairs[1:]:
        step.step(x, y)
        assert _storage(step) == first


def test_no_host_read_inside_a_step_and_the_guard_is_live():
    """Steps after the warm-up under the guard complete, with the eager step's numbers; the
    guard does refuse a host read (so the completed steps made none)."""
    losses, params, _ = eager_run("dense", "adam", FORWARD, BACKWARD, 5)
    model, _ = build("dense", 8, FORWARD, BACKWARD)
    step = CapturedStep(model, loss_fn, optimizer("adam", model), *data("dense", 4),
                        check=False)
    for k, (x, y) in enumerate(batches("dense", 5)):
        if k == 0:
            step.step(x, y)     # builds the solvers and the optimizer's state
            continue
        with step.guarded():
            loss = step.step(x, y)
            for read in (lambda: loss.item(), lambda: float(loss), lambda: bool(loss),
                         lambda: loss.tolist(), lambda: loss.numpy(), lambda: loss.cpu()):
                with pytest.raises(HostSyncError):
                    read()
        step.check()
        assert loss.item() == losses[k]
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    # every patched method is restored
    assert torch.ones(()).item() == 1.0 and bool(torch.ones(()))


def test_the_guard_holds_in_the_threads_inside_it_alone():
    """Virtual ranks are threads: a rank reading its norms after its step must not fail
    while another rank's step is guarded. Guards entered and left by two threads in
    crossed order leave Tensor as it was."""
    import threading

    inside, done = threading.Event(), threading.Event()
    seen = {}

    def other():
        with host_reads_forbidden():
            inside.set()
            done.wait(30)
            try:
                torch.ones(()).item()
            except HostSyncError:
                seen["other raised"] = True

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(30)
    x = torch.ones(2)
    assert x.tolist() == [1.0, 1.0] and float(x.sum()) == 2.0     # not inside a guard here
    with host_reads_forbidden([x]):
        assert x.tolist() == [1.0, 1.0]        # allowed by this guard
        with pytest.raises(HostSyncError):
            x.sum().item()
        done.set()
        thread.join(30)
    assert seen == {"other raised": True}
    assert "item" not in torch.Tensor.__dict__ and torch.ones(()).item() == 1.0


def on_another_thread(work):
    """`work()` on a thread of its own, as autograd runs a backward pass's CUDA work on
    its device thread while the caller waits; its exception raised here."""
    failed = []

    def target():
        try:
            work()
        except BaseException as err:    # handed to the caller, as autograd hands it
            failed.append(err)
    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def test_the_guarded_step_runs_its_adjoint_on_its_own_thread(monkeypatch):
    """On CUDA autograd runs the backward pass on its device thread, outside the guard
    that the step's thread is in: the guarded step runs it with multithreading off, under
    which torch runs every node on the calling thread, and a read in the adjoint goes
    through in the eager first step and is refused, named, in the second."""
    model, _ = build("dense", 8, FORWARD, BACKWARD)
    step = CapturedStep(model, loss_fn, optimizer("sgd", model), *data("dense", 4))
    solve_backward = model._solve_backward
    threads_allowed = []

    def reading(grad_out, *args):
        threads_allowed.append(torch._C._is_multithreading_enabled())
        grad_out.abs().max().item()
        return solve_backward(grad_out, *args)
    monkeypatch.setattr(model, "_solve_backward", reading)
    step.step(*data("dense", 4))
    with pytest.raises(CaptureError, match=r"\(Tensor\.item\(\) of a tensor of shape \(\) on "
                                           r"cpu\) in reading at .*test_capture\.py"):
        step.step(*data("dense", 4))
    assert threads_allowed == [True, False]


class _ScaledGradient(torch.autograd.Function):
    """Identity whose backward scales the gradient by a number read on the host, and notes
    whether autograd may run it on a device thread of its own (as on CUDA)."""

    threads_allowed: list[bool] = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _ScaledGradient.threads_allowed.append(torch._C._is_multithreading_enabled())
        return grad / max(grad.abs().max().item(), 1.0)


class _ClosingReadsInBackward(nn.Linear):
    def forward(self, x):
        return super().forward(_ScaledGradient.apply(x))


def test_a_read_in_the_backward_of_the_closing_is_refused():
    """On CUDA autograd runs the closing's backward on its device thread: the guarded step
    runs its backward pass on its own thread instead (torch runs every node there while
    multithreading is off), and the read is refused there, naming its line."""
    torch.manual_seed(0)
    model = mgrit.LayerParallel(lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh()), 8,
                                forward=FORWARD, backward=BACKWARD, opening=nn.Linear(5, 8),
                                closing=_ClosingReadsInBackward(8, 3)).double()
    step = CapturedStep(model, loss_fn, optimizer("sgd", model), *data("dense", 4))
    _ScaledGradient.threads_allowed.clear()
    step.step(*data("dense", 4))      # the eager first step reads as it likes
    with pytest.raises(CaptureError, match=r"Tensor\.item\(\) of a tensor of shape \(\) on "
                                           r"cpu\) in backward at .*test_capture\.py"):
        step.step(*data("dense", 4))
    assert _ScaledGradient.threads_allowed == [True, False]


class _OpeningReads(nn.Linear):
    """Normalises by a scale read on the host (the step modules cannot: vmap refuses it)."""

    def forward(self, x):
        return super().forward(x / x.abs().max().item())


class _ClosingReads(nn.Linear):
    def forward(self, x):
        return super().forward(x) * float(x.abs().max() < 1e6)


@pytest.mark.parametrize("where", ["opening", "closing"])
def test_a_module_that_reads_the_host_is_refused_with_its_name(where):
    torch.manual_seed(0)
    opening = _OpeningReads(5, 8) if where == "opening" else nn.Linear(5, 8)
    closing = _ClosingReads(8, 3) if where == "closing" else nn.Linear(8, 3)
    model = mgrit.LayerParallel(lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh()), 8,
                                forward=FORWARD, backward=BACKWARD, opening=opening,
                                closing=closing).double()
    step = CapturedStep(model, loss_fn, optimizer("sgd", model), *data("dense", 4))
    step.step(*data("dense", 4))      # the eager first step reads as it likes
    expected = (r"Tensor\.item\(\).*module 'opening' \(_OpeningReads\), in forward at "
                r".*test_capture\.py" if where == "opening" else
                r"Tensor\.float\(\).*module 'closing' \(_ClosingReads\), in forward at "
                r".*test_capture\.py")
    with pytest.raises(CaptureError, match=expected):
        step.step(*data("dense", 4))


def test_what_cannot_be_captured_is_refused_before_any_step():
    model, _ = build("dense", 8, mgrit.Config(levels=2, tol=1e-6, max_iter=5), BACKWARD)
    x, y = data("dense", 4)
    with pytest.raises(CaptureError, match=r"forward solve has tol=1e-06.*use tol=0"):
        CapturedStep(model, loss_fn, optimizer("sgd", model), x, y)
    model, _ = build("dense", 8, FORWARD, BACKWARD)
    model.eval()
    with pytest.raises(CaptureError, match=r"model\.train\(\)"):
        CapturedStep(model, loss_fn, optimizer("sgd", model), x, y)
    torch.manual_seed(0)
    dropout = mgrit.LayerParallel(lambda: nn.Sequential(nn.Linear(8, 8), mgrit.nn.Dropout(0.1)),
                                  8, forward=FORWARD, backward=BACKWARD)
    with pytest.raises(CaptureError, match="draws random numbers"):
        CapturedStep(dropout, loss_fn, optimizer("sgd", dropout), torch.zeros(4, 8),
                     torch.zeros(4, dtype=torch.long))
    # on CUDA, torch's optimizers need their step count on the device
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(CaptureError, match=r"Adam runs inside a CUDA graph only with "
                                           r"capturable=True.*Adam\(\.\.\., capturable=True\)"):
        _check_optimizer(torch.optim.Adam(params))
    _check_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))


def test_a_batch_of_another_shape_and_a_later_tolerance_are_refused():
    model, _ = build("dense", 8, FORWARD, BACKWARD)
    step = CapturedStep(model, loss_fn, optimizer("sgd", model), *data("dense", 4))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CaptureError, match=r"input has shape \(6, 5\).*built for shape \(4, 5\)"):
        step.step(*data("dense", 6))
    x, y = data("dense", 4)
    with pytest.raises(CaptureError, match=r"target has shape \(4,\) and dtype torch.int32.*"
                                           r"torch.int64"):
        step.step(x, y.int())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    step.step(x, y)
    model.set_solvers(backward=mgrit.Config(levels=2, tol=1e-8))
    with pytest.raises(CaptureError, match="backward solve has tol=1e-08"):
        step.step(x, y)


def test_settings_changed_by_set_solvers_are_captured_again():
    """A captured step replays its graph until set_solvers changes the options; the next
    steps warm up and capture again, and every step has the eager run's numbers."""
    more = (mgrit.Config(levels=2, coarsening=4, tol=0.0, max_iter=3, min_coarse=1),
            mgrit.Config(levels=3, coarsening=2, tol=0.0, max_iter=2, min_coarse=1))
    steps, change = 8, 5
    losses, params, histories = eager_run("dense", "sgd", FORWARD, BACKWARD, steps,
                                          (change, more))
    model, _ = build("dense", 8, FORWARD, BACKWARD)
    step = CapturedStep(model, loss_fn, optimizer("sgd", model), *data("dense", 4))
    capturer = stand_in(step)
    counts = []
    for k, (x, y) in enumerate(batches("dense", steps)):
        if k == change:
            model.set_solvers(*more)
        assert step.step(x, y).item() == losses[k]
        assert step.stats()["forward"]["residuals"] == histories[k]["forward"]
        counts.append((capturer.warm_ups, capturer.captured, capturer.replays))
    # two warm-ups, a capture (replayed at once) and replays; after the change again
    assert counts == [(1, 0, 0), (2, 0, 0), (2, 1, 1), (2, 1, 2), (2, 1, 3),
                      (3, 1, 3), (4, 1, 3), (4, 2, 4)]
    assert step.stats()["forward"]["iterations"] == 3
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


def test_the_same_options_set_again_build_new_solvers_which_are_captured_again():
    """set_solvers with unchanged options builds the solvers again (their storage is new):
    the next steps warm up and capture again rather than replay a graph of the old
    storage, and keep the eager run's numbers."""
    steps, change = 6, 3
    losses, params, _ = eager_run("dense", "sgd", FORWARD, BACKWARD, steps,
                                  (change, (FORWARD, BACKWARD)))
    model, _ = build("dense", 8, FORWARD, BACKWARD)
    step = CapturedStep(model, loss_fn, optimizer("sgd", model), *data("dense", 4))
    capturer = stand_in(step)
    for k, (x, y) in enumerate(batches("dense", steps)):
        if k == change:
            model.set_solvers(FORWARD, BACKWARD)
        assert step.step(x, y).item() == losses[k]
    assert (capturer.warm_ups, capturer.captured, capturer.replays) == (4, 2, 2)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


def test_a_divergent_residual_raises_after_the_step_naming_pass_and_cycle():
    model, _ = build("dense", 8, FORWARD, BACKWARD)
    step = CapturedStep(model, loss_fn, optimizer("sgd", model), *data("dense", 4))
    x, y = data("dense", 4)
    step.step(x, y)
    x[0, 0] = float("nan")
    with pytest.raises(mgrit.DivergenceError, match=r"residual nan after cycle 1") as err:
        step.step(x, y)
    assert any("forward solve of a captured training step" in n for n in err.value.__notes__)


@pytest.mark.parametrize("tol_kind", ["absolute", "relative"])
def test_a_captured_solve_keeps_the_deferred_histories_norms_on_the_device(tol_kind):
    """The solver alone: `Solver.captured` gives the norms of the eager fixed-count solve
    (DeferredHistory) to the bit, as a float64 tensor, with the same states."""
    n, t1 = 32, 1.0
    prop, u0 = resnet_problem(num_steps=n)
    cfg = mgrit.Config(levels=3, coarsening=4, tol=0.0, max_iter=3, tol_kind=tol_kind)
    eager = Solver(prop, u0, n, 0.0, t1, cfg).solve(u0)
    solver = Solver(prop, u0, n, 0.0, t1, cfg)
    solver.captured = True
    with host_reads_forbidden():
        captured = solver.solve(u0)
    assert isinstance(captured.residuals, torch.Tensor)
    assert captured.residuals.tolist() == eager.residuals
    assert captured.iterations == eager.iterations == 3
    if tol_kind == "relative":
        assert captured.initial_residual.item() == eager.initial_residual
    assert torch.equal(captured.final, eager.final)
    assert torch.equal(captured.states, eager.states)


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_captured_step_on_several_ranks_gives_the_eager_steps_numbers(mpi, nprocs):
    """On 2 and 3 ranks (7 layers, unequal shares) every rank's losses, parameters and
    residual histories after 4 SGD-momentum and Adam steps are the eager step's to the
    bit, three of the steps run under the host-read guard, and training moved the
    parameters (so equal parameters are no accident of a step that did nothing); a
    controller of a captured step probes it on every rank alike."""
    run = mpi("capture.py", nprocs, timeout=300)
    assert run.returncode == 0, run.stderr
    for rank, rep in run.by_rank().items():
        assert rep["size"] == nprocs
        for name, r in rep["results"].items():
            assert r["losses"] and r["params"] and r["histories"], (rank, name, r)
            assert r["guarded"] == 3 and r["cycles"] == [2, 2, 2, 2], (rank, name, r)
            assert r["moved"] > 1e-3, (rank, name, r)
    # a controller watching the captured step probed it (collectively) and every rank
    # measured and decided alike
    controls = [rep["control"] for rep in run.by_rank().values()]
    assert controls[0]["probes"] and all(c == controls[0] for c in controls)


# run by `pytest -m gpu` (benchmarks/gpu_check.sh), skipped without a CUDA device
needs_gpu = pytest.mark.gpu


@needs_gpu
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_on_cuda_the_step_is_one_graph_with_the_eager_steps_numbers(opt_name):
    """On one CUDA device the third step is captured once and every later step replays it;
    losses, parameters and histories match the eager CUDA step (float64, to 1e-12: a
    replay runs the kernels that the eager step launches, on the same values)."""
    def make():
        model, _ = build("dense", 8, FORWARD, BACKWARD)
        model = model.cuda()
        opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_name == "sgd"
               else torch.optim.Adam(model.parameters(), lr=0.01, capturable=True))
        return model, opt

    pairs = [tuple(t.cuda() for t in data("dense", 4, seed=k)) for k in range(6)]
    model, opt = make()
    histories = []
    losses = train_eagerly(model, opt, loss_fn, pairs,
                           after=lambda: histories.append(model.stats["forward"]["residuals"]))
    eager = [p.detach().clone() for p in model.parameters()]
    model, opt = make()
    step = CapturedStep(model, loss_fn, opt, *pairs[0])
    for k, (x, y) in enumerate(pairs):
        assert step.step(x, y).item() == pytest.approx(losses[k], rel=1e-12)
        assert step.stats()["forward"]["residuals"] == pytest.approx(histories[k], rel=1e-10)
    assert step.captures == 1 and step._graph is not None
    for a, b in zip(eager, model.parameters()):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def test_closing_gives_the_model_back_to_eager_training():
    """After close() the same model trains eagerly (float residual lists, a tolerance
    allowed), continuing with the eager run's numbers."""
    losses, params, histories = eager_run("dense", "sgd", FORWARD, BACKWARD, 4)
    model, _ = build("dense", 8, FORWARD, BACKWARD)
    opt = optimizer("sgd", model)
    step = CapturedStep(model, loss_fn, opt, *data("dense", 4))
    pairs = batches("dense", 4)
    for x, y in pairs[:2]:
        step.step(x, y)
    step.close()
    for k, (x, y) in enumerate(pairs[2:], start=2):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        assert loss.item() == losses[k]
        assert model.stats["forward"]["residuals"] == histories[k]["forward"]
        assert isinstance(model.stats["forward"]["residuals"], list)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    model.set_solvers(forward=mgrit.Config(levels=2, tol=1e-8, max_iter=4))
    loss_fn(model(pairs[0][0]), pairs[0][1]).backward()


def transformer_case(steps, opt="adam", kernels=None, comm=None):
    """A maker of a TransformerBlock stack (batched step, causal attention, a dropout of
    p = 0 that draws nothing) on `comm` and its optimizer (`opt` as in `nets.optimizer`),
    (input, target) pairs, and eager training's losses and parameters after those steps."""
    def make():
        torch.manual_seed(0)
        model = mgrit.LayerParallel(lambda: mgrit.nn.TransformerBlock(8, 2, 16, causal=True),
                                    8, forward=FORWARD, backward=BACKWARD,
                                    closing=nn.Linear(8, 8), kernels=kernels,
                                    comm=comm).double()
        return model, (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                       if opt == "sgd" else
                       torch.optim.Adam(model.parameters(), lr=1e-3,
                                        capturable=opt == "device adam"))

    gen = torch.Generator().manual_seed(1)
    pairs = [tuple(torch.randn(2, 5, 8, generator=gen, dtype=torch.float64) for _ in "xy")
             for _ in range(steps)]
    model, optim = make()
    losses = train_eagerly(model, optim, nn.functional.mse_loss, pairs)
    return make, pairs, losses, [p.detach().clone() for p in model.parameters()]


def test_a_transformer_stack_is_captured_with_the_eager_numbers():
    """4 Adam steps of a transformer stack: losses and parameters equal to the eager
    step's to the bit."""
    make, pairs, losses, eager = transformer_case(4)
    model, opt = make()
    step = CapturedStep(model, nn.functional.mse_loss, opt, *pairs[0])
    assert [step.step(x, y).item() for x, y in pairs] == losses
    assert all(torch.equal(a, b) for a, b in zip(eager, model.parameters()))
    assert not any(torch.equal(a, b) for a, b in zip(eager, make()[0].parameters()))


# with the controller ------------------------------------------------------------------------

CALIBRATION = mgrit.nn.controller.Calibration(mgrit.nn.controller.Units(1e-5, 1e-7, 1e-6),
                                              mgrit.nn.controller.Units(2e-5, 2e-7, 2e-6))
# march steps priced high: exact stepping costs more than the setting, which stays
STEADY = mgrit.nn.controller.Calibration(mgrit.nn.controller.Units(1e-6, 1e-8, 1e-3),
                                         mgrit.nn.controller.Units(1e-6, 1e-8, 1e-3))


def probed_error(model, trained, x, y, kernels=None):
    """The relative gradient error of the setting `trained` at `model`'s weights on
    (x, y): a model built with the setting and loaded with the weights, against serial
    autograd through the exported network."""
    from benchmarks.training import gradient_agreement, gradient_pairs
    again, _ = build("dense", model.num_steps, *trained, kernels=kernels)
    again.load_state_dict(model.state_dict())
    loss_fn(again(x), y).backward()
    serial = model.to_serial()
    loss_fn(serial(x), y).backward()
    return gradient_agreement(gradient_pairs(again, serial))["relative_error"]


def test_a_controller_probes_a_captured_step_after_it_at_the_updated_weights():
    """The controller's probe after a (replayed) step measures the training setting's
    gradient against the exact one at the updated weights: the error it records equals
    the one computed here from a model built with the setting and loaded with those
    weights against serial autograd through the exported network, on the step's batch."""
    model, _ = build("dense", 8, FORWARD, BACKWARD)
    controller = mgrit.nn.Controller(model, calibration=STEADY, every=3, max_every=3,
                                     warm_trials=False, hierarchies=False)
    step = CapturedStep(model, loss_fn, optimizer("sgd", model), *data("dense", 4),
                        controller=controller)
    capturer = stand_in(step)
    for k, (x, y) in enumerate(batches("dense", 7)):
        trained = (model.forward_config, model.backward_config)
        step.step(x, y)
        if k in (0, 3):
            error = probed_error(model, trained, x, y)
            assert error > 1e-6
            assert controller.probes[-1]["error"] == pytest.approx(error, rel=1e-9)
    assert [p["step"] for p in controller.probes] == [0, 3, 6]
    assert not controller.decisions and controller.step == 7 and capturer.replays > 0


def test_a_controllers_change_is_captured_again_with_the_eager_numbers():
    """A change the controller makes after step 0 is captured again from step 1 on, and
    every step has the numbers of eager training that changes the same options there."""
    target = mgrit.nn.Setting(3, 2, 3)
    model, _ = build("dense", 8, FORWARD, BACKWARD)
    controller = mgrit.nn.Controller(
        model, calibration=CALIBRATION,
        policy=ForcedPolicy(mgrit.nn.Setting(2, 1, 3), target, every=4))
    options = controller.configs(target)
    losses, params, _ = eager_run("dense", "sgd", FORWARD, BACKWARD, 6, (1, options))
    step = CapturedStep(model, loss_fn, optimizer("sgd", model), *data("dense", 4),
                        controller=controller)
    capturer = stand_in(step)
    for k, (x, y) in enumerate(batches("dense", 6)):
        assert step.step(x, y).item() == losses[k]
    assert (model.forward_config, model.backward_config) == options
    assert [d["step"] for d in controller.decisions] == [0]
    # step 0 warms up; after the change steps 1-2 warm up again, step 3 is captured (and
    # replayed), 4 and 5 replay
    assert (capturer.warm_ups, capturer.captured, capturer.replays) == (3, 1, 3)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


def test_a_controller_of_another_model_is_refused():
    model, _ = build("dense", 8, FORWARD, BACKWARD)
    other, _ = build("dense", 8, FORWARD, BACKWARD)
    with pytest.raises(ValueError, match="another model"):
        CapturedStep(model, loss_fn, optimizer("sgd", model), *data("dense", 4),
                     controller=mgrit.nn.Controller(other))
    with pytest.raises(TypeError, match="Controller"):
        CapturedStep(model, loss_fn, optimizer("sgd", model), *data("dense", 4),
                     controller=object())
