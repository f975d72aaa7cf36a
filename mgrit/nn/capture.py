"""`CapturedStep`: a whole layer-parallel training step (forward solve, loss, adjoint solve,
parameter gradients, optimizer update) on static buffers and without host reads, captured
on a CUDA model as one CUDA graph (one rank) or as graphs between its messages (several
ranks, `mgrit.comm.cuts`) and replayed, run eagerly elsewhere;
`CapturedForward`: the same for a forward pass without gradients (opening, forward solve,
closing), in training or in evaluation mode.

What makes them capturable lives where the work does: solves of a fixed cycle count whose
residual norms stay on the device (`mgrit.core.device_history`, `Solver.captured`), adjoint
steps that do not look for all-zero cotangents (`AdjointPropagator.skip_zero_rows`), both
switched on for training's passes by `Passes.set_captured` and for passes without
gradients by `Passes.set_captured_no_grad`. This module checks what cannot be captured,
before any capture, and runs the stages of a step or pass: an eager first one that builds
the solvers (and the optimizer's state), a second under the host-read guard
(`capture_guard`; on several ranks its messages checked as a capture needs them), then
the capture and its replays (docs/training.md, "Captured steps").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import Tensor

from ..comm.cuts import CutError, Cuts, Running
from ..core.config import Config
from ..core.device_history import check_norms
from ..execute import CudaCapture
from .capture_guard import HostSyncError, culprit, host_reads_forbidden
from .controller.control import Controller
from .layer_parallel import LayerParallel

PASSES = ("forward", "backward")


class CaptureError(ValueError):
    """The model, optimizer or settings cannot run as a captured step; says why and what
    to change."""


class _Captured:
    """What a captured step and a captured forward pass share: static inputs, the stages
    (eager, eager under the guard, captured, replayed; started again when the settings
    change), the checks of the solves' options and the residual histories on the device.
    A subclass says what it runs (`_run`), which solves it holds (`_solves`) and how it
    is named in messages (`what`)."""

    what = "training step"

    def __init__(self, model: LayerParallel, examples: dict[str, Tensor], check: bool
                 ) -> None:
        if not isinstance(model, LayerParallel):
            raise TypeError(f"model must be a mgrit.nn.LayerParallel, got "
                            f"{type(model).__name__}")
        for name, value in examples.items():
            if not isinstance(value, Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
        self.model = model
        self.check_each_step = bool(check)
        self.device = next(iter(examples.values())).device
        # captured on a CUDA model: as one graph on one rank; on several ranks or replicas
        # as graphs between the messages, which its communicators cut out (`CutComm`)
        self.graphs = self.device.type == "cuda"
        self._cuts: Cuts | None = model._cuts
        self._names = [name.removeprefix("example_") for name in examples]
        self.inputs = tuple(value.detach().clone() for value in examples.values())
        self._history: dict[str, Tensor] = {}
        self._initial: dict[str, Any] = {}
        self._key: tuple | None = None
        self._stage = 0
        self._graph: Any = None
        # warm-up runs and captures on one side stream (`CudaCapture`, or a stand-in with
        # its `warm_up` and `capture`)
        self._capturer: Any = CudaCapture()
        self.runs = 0
        self.captures = 0

    # checks -----------------------------------------------------------------------------
    def _solves(self) -> list[tuple[str, Config]]:
        """(pass, its options) of the solves a run holds."""
        raise NotImplementedError

    def _settings(self) -> tuple:
        """What a capture is valid for: the solvers (their set: `Passes.generation` counts
        the times it was dropped), the mode, the options of the solves and where the
        parameters live (a graph reads them at the addresses it was captured with)."""
        model = self.model
        return (id(model._passes), model._passes.generation, model.training,
                tuple(p.data_ptr() for p in model.parameters()),
                *(tuple(sorted(cfg.describe().items())) for _, cfg in self._solves()))

    def _check_settings(self) -> None:
        model = self.model
        if model._held_draw_step is not None:
            raise CaptureError(f"a captured {self.what} cannot run inside model.probing(): "
                               "probes run eagerly, after the step")
        for kind, cfg in self._solves():
            if cfg.tol != 0.0:
                raise CaptureError(
                    f"the {kind} solve has tol={cfg.tol}: a tolerance stops a solve at a "
                    "residual read on the host after every cycle, which a CUDA graph cannot "
                    f"do; use tol=0 (max_iter={cfg.max_iter} cycles, the residual history "
                    f"is read after the {self.what})")
            if cfg.cuda_graphs and self.graphs:
                raise CaptureError(
                    f"the {kind} solve has cuda_graphs=True, which captures relaxation "
                    f"sweeps in graphs of their own; a captured {self.what} is captured "
                    "whole (one graph, or graphs between its messages on several ranks), "
                    "and graphs do not nest: use cuda_graphs=False")
        if model.training and _draws(model):
            raise CaptureError(
                "the step module draws random numbers (dropout): its keys are made on the "
                f"host for every {self.what}, which a replayed graph would repeat; "
                f"run it without {type(self).__name__}")

    def _take(self, given: tuple[Tensor, ...]) -> None:
        """Copy a run's tensors into the static inputs, after checking them all."""
        for name, value, static in zip(self._names, given, self.inputs):
            if not isinstance(value, Tensor):
                raise TypeError(f"the {name} must be a tensor, got {type(value).__name__}")
            if value.shape != static.shape or value.dtype != static.dtype:
                raise CaptureError(
                    f"the {name} has shape {tuple(value.shape)} and dtype {value.dtype}; "
                    f"this {self.what} was built for shape {tuple(static.shape)} and dtype "
                    f"{static.dtype} (its static buffers, and a graph, have one shape): "
                    f"make another {type(self).__name__} for the other shape")
        for value, static in zip(given, self.inputs):
            static.copy_(value)

    # the stages -------------------------------------------------------------------------
    def _advance(self, given: tuple[Tensor, ...]) -> None:
        """One run on `given`: eager while the solvers and their states are being built,
        then eager under the guard, then captured and replayed (on CUDA; run eagerly
        elsewhere); from the start again when the settings changed."""
        self._take(given)
        key = self._settings()
        if key != self._key:
            # first run, or new solvers or options: any graph is stale
            self._check_settings()
            self._key, self._stage, self._graph = key, 0, None
        if self._graph is not None:
            self._replay()
        elif self._stage == 0:
            self._warm(self._run)
            self._check_settings()      # whether the step module draws is known now
        elif self._stage == 1:
            self._warm(self._guarded_run)
        elif self.graphs:
            self._capture()
        else:
            self._run()
        self._stage += 1
        self.runs += 1
        if self.check_each_step:
            self.check()

    def _run(self) -> None:
        raise NotImplementedError

    def _guarded_run(self) -> None:
        """`_run` under the host-read guard; a read is refused naming where it was made. On
        several ranks its messages run as they come, checked as a capture would check
        them (`mgrit.comm.cuts.Running`)."""
        try:
            with self.guarded(), self._cutting():
                self._run()
        except HostSyncError as err:
            raise CaptureError(
                f"the {self.what} reads a tensor on the host ({err}) in "
                f"{culprit(err, self.model)}: a captured {self.what} cannot (a graph would "
                "keep the value read at capture and the read waits for the device); keep "
                "the value on the device (torch.where instead of if, no .item())") from None

    @contextlib.contextmanager
    def _cutting(self) -> Iterator[None]:
        """The run's messages run as they come (`Running`, on several ranks; else nothing),
        with what a capture cannot repeat refused as a `CaptureError`."""
        cuts = self._cuts
        if cuts is None:
            yield
            return
        cuts.begin(Running())
        try:
            yield
        except BaseException as err:
            cuts.end(complete=False)
            if isinstance(err, CutError):
                raise self._cut_error(err) from None
            raise
        error = None
        try:
            cuts.end()
        except CutError as err:
            error = err
        # a message left open is found on the rank that posted it: every rank learns of it,
        # so that all of them refuse the capture rather than one
        failed = 1.0 if error is not None else 0.0
        for comm in (self.model.comm, self.model.data_comm):
            if comm is not None and comm.size > 1:
                failed = comm.allreduce_sum(failed)
        if error is not None:
            raise self._cut_error(error) from None
        if failed:
            raise self._cut_error(CutError(
                "another rank's run posted a message it did not complete (that rank's "
                "error names it)")) from None

    def _cut_error(self, err: CutError) -> CaptureError:
        return CaptureError(f"a captured {self.what} on several ranks runs its messages "
                            f"between graphs, and this one cannot: {err}")

    def _allowed_reads(self) -> list[Tensor]:
        """Tensors that may be read on the host inside a run."""
        return []

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """Host reads raise inside (`host_reads_forbidden`), but of `_allowed_reads`, and a
        backward pass runs on this thread: the guard holds per thread, and on CUDA autograd
        would run the backward (the adjoint solve, the opening's, the closing's, the
        loss's) on a device thread of its own, where a read would go unseen until the
        capture failed on it. With multithreading off torch's engine queues every node on
        the calling thread."""
        with host_reads_forbidden(self._allowed_reads()), \
                torch.autograd.set_multithreading_enabled(False):
            yield

    def _warm(self, run: Callable[[], None]) -> None:
        """An eager run; before a capture on the stream that captures, as capturing asks
        (libraries make per-stream handles at their first use)."""
        if self.graphs:
            self._capturer.warm_up(self.inputs[0], run)
        else:
            run()

    def _capture(self) -> None:
        """Capture the run as one CUDA graph and replay it (capturing runs nothing); on
        several ranks as graphs between its messages (`mgrit.execute.Segmented`, which
        capturing runs once, and whose first replay is therefore none)."""
        cuts = () if self._cuts is None else (self._cuts,)
        # a gathered copy of the weights made before (by a probe) would be read by the
        # graph, not gathered in it: `LayerStack.forget_gathered`
        self.model.layers.forget_gathered()
        try:
            graph = self._capturer.capture(self.inputs[0], self._run, *cuts)
        except CutError as err:
            raise self._cut_error(err) from None
        except RuntimeError as err:
            raise CaptureError(f"capturing the {self.what} failed ({err}): something in "
                               "it copies between host and device or synchronises") from err
        self._graph = graph
        self.captures += 1
        self._replay()

    def _replay(self) -> None:
        """Replay the graph. It updates the weights without moving their version counters,
        so the gathered copies of them that trust those go (`LayerStack.forget_gathered`)."""
        self._graph.replay()
        self.model.layers.forget_gathered()

    def _hold(self, captured: bool) -> None:
        """Make the model's passes of this kind captured solves (True) or ordinary ones."""
        raise NotImplementedError

    def close(self) -> None:
        """Give the model back: its passes of this kind are ordinary solves again (a
        tolerance allowed, float residual lists in `model.stats`); the graph is dropped."""
        self._hold(False)
        self._graph, self._key = None, None

    def _keep_history(self) -> None:
        """The latest run's residual norms: static tensors, which a replay writes again."""
        stats = self.model.stats
        self._history = {kind: stats[kind]["residuals"] for kind, _ in self._solves()}
        self._initial = {kind: stats[kind]["initial_norm"] for kind, _ in self._solves()}

    # residual histories -----------------------------------------------------------------
    def history(self) -> dict[str, Tensor]:
        """The latest run's residual norms per pass ("forward", and "backward" in a
        training step), float64 tensors on the device (views of static buffers: the next
        run overwrites them)."""
        return dict(self._history)

    def stats(self) -> dict[str, dict[str, Any]]:
        """The latest run's cycles and residual norms per pass, read on the host."""
        return {kind: {"iterations": len(norms), "residuals": norms.tolist()}
                for kind, norms in self._history.items()}

    def check(self) -> None:
        """Read the latest run's residual norms (one host read per pass) and raise
        `DivergenceError` at a NaN/Inf one or one past `divergence_factor` times the
        first, naming the pass and cycle."""
        options = dict(self._solves())
        for kind, norms in self._history.items():
            check_norms(norms, options[kind].divergence_factor, kind,
                        f"a captured {self.what}")


class CapturedStep(_Captured):
    """`step(x, y)` = one training step of `model` on the batch (x, y): zero the gradients,
    `loss_fn(model(x), y).backward()`, `optimizer.step()`; returns the loss, a tensor that
    the next step overwrites (as it does `output`, the step's `model(x)`, detached).

    Every step runs on the same storage: the batch is copied into static inputs shaped like
    `example_input` and `example_target` (a batch of another shape is refused), states,
    gradients and the optimizer's state are made by the first step and written in place
    after. Both solves run their `max_iter` cycles (tol=0 is required) and keep their
    residual norms on the device: `history()` returns them as tensors, `stats()` reads them.
    With `check` (default) every step ends with one host read of those norms, which raises
    `DivergenceError` naming the pass and cycle of a NaN or growing residual; without it,
    call `check()` when convenient.

    On CUDA the third step is captured and every later step replays it: on one rank as one
    CUDA graph; on several ranks (or data-parallel replicas) as graphs of the work between
    the messages, which a replay runs in order with the messages (host MPI calls) between
    them. The first two steps run eagerly (the second under a guard that names any module
    reading a tensor on the host, and, on several ranks, checking that every message the
    step posts it also completes). On a CPU the same static-buffer step runs eagerly.
    `set_solvers` between steps is seen at the next step, which starts the stages again
    with the new solvers. With `controller` (a `mgrit.nn.Controller` of the same model)
    every step ends with its `after_step`: its probes run eagerly, outside any graph, at the
    updated weights, and a change of settings is captured again at the next steps. While a
    CapturedStep holds the model its passes with gradients are captured solves; `close()`
    gives it back to eager training.
    """

    def __init__(self, model: LayerParallel, loss_fn: Callable[[Tensor, Tensor], Tensor],
                 optimizer: torch.optim.Optimizer, example_input: Tensor,
                 example_target: Tensor, check: bool = True,
                 controller: Controller | None = None) -> None:
        super().__init__(model, {"example_input": example_input,
                                 "example_target": example_target}, check)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if controller is not None:
            if not isinstance(controller, Controller):
                raise TypeError(f"controller must be a mgrit.nn.Controller, got "
                                f"{type(controller).__name__}")
            if controller.model is not model:
                raise ValueError("the controller watches another model than this step's: "
                                 "make it with Controller(model) for the same model")
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self.controller = controller
        self._check_settings()
        if self.device.type == "cuda":
            _check_optimizer(optimizer)
        self.loss: Tensor | None = None
        self.output: Tensor | None = None
        self._hold(True)

    @property
    def steps(self) -> int:
        """Steps taken so far."""
        return self.runs

    def _solves(self) -> list[tuple[str, Config]]:
        return [(kind, getattr(self.model, f"{kind}_config")) for kind in PASSES]

    def _check_settings(self) -> None:
        if not self.model.training:
            raise CaptureError("a captured step is a training step: call model.train() "
                               "before it")
        super()._check_settings()

    # the step ---------------------------------------------------------------------------
    def step(self, x: Tensor, y: Tensor) -> Tensor:
        """One training step on (x, y); returns the loss (a tensor, overwritten by the next
        step)."""
        self._advance((x, y))
        if self.controller is not None:
            # after the step, outside any graph: a probe, and a change of settings that
            # the next step captures again
            self.controller.after_step(
                lambda: self.loss_fn(self.model(self.inputs[0]), self.inputs[1]),
                {kind: {"residuals": self._history[kind],
                        "initial_norm": self._initial[kind]} for kind in PASSES})
        return self.loss

    def _run(self) -> None:
        """The step's work, on the static inputs; the loss and the output into static
        tensors."""
        self.optimizer.zero_grad(set_to_none=False)
        out = self.model(self.inputs[0])
        loss = self.loss_fn(out, self.inputs[1])
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            got = f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss)
            raise CaptureError(f"loss_fn must return a scalar tensor, got {got}")
        loss.backward()
        self.optimizer.step()
        self.loss = keep_static(self.loss, loss)
        self.output = keep_static(self.output, out)
        self._keep_history()

    def _allowed_reads(self) -> list[Tensor]:
        """The step counts that torch's optimizers keep on the host on a CPU
        (capturable=True is for CUDA alone; on CUDA a host step count is refused before
        any step)."""
        return [state["step"] for state in self.optimizer.state.values()
                if isinstance(state.get("step"), Tensor)
                and state["step"].device.type == "cpu"]

    def _hold(self, captured: bool) -> None:
        """The passes with gradients; their solvers are built again, warm from where the
        old ones left off (`Passes.set_captured`)."""
        self.model._passes.set_captured(captured)


class CapturedForward(_Captured):
    """`forward(x)` (or calling it) = `model(x)` without gradients: the opening, the forward
    solve and the closing, on static buffers and without host reads; returns the output, a
    tensor that the next pass overwrites.

    The pass solves as the model's mode says: in training mode with the forward options
    (the approximate forward pass of training), in evaluation mode (`model.eval()`) with
    the inference options (by default exact sequential stepping; give `LayerParallel` an
    `inference=Config(levels=3, tol=0.0, max_iter=2)` to solve it with MGRIT). That solve
    needs tol=0, keeps its residual norms on the device (`history()["forward"]`) and, with
    `check` (default), ends every pass with one host read of them, which raises
    `DivergenceError` at a NaN or growing residual.

    On CUDA the third pass is captured (one CUDA graph on one rank, graphs between the
    messages on several) and every later pass replays it; the first two run eagerly (the
    second under the host-read guard). Elsewhere the same static-buffer pass runs
    eagerly. A change of mode, of options
    (`set_solvers`) or of where the parameters live is seen at the next pass, which starts
    the stages again. Training between passes (a `CapturedStep` or eager steps that update
    the parameters in place) is what the next replay reads. While a CapturedForward holds
    the model its forward passes without gradients are captured solves; `close()` gives
    them back.
    """

    what = "forward pass"

    def __init__(self, model: LayerParallel, example_input: Tensor, check: bool = True
                 ) -> None:
        super().__init__(model, {"example_input": example_input}, check)
        self._check_settings()
        self.output: Tensor | None = None
        self._hold(True)

    def _solves(self) -> list[tuple[str, Config]]:
        model = self.model
        return [("forward", model.forward_config if model.training
                 else model.inference_config)]

    def forward(self, x: Tensor) -> Tensor:
        """The output for the input `x` (a tensor, overwritten by the next pass)."""
        self._advance((x,))
        return self.output

    __call__ = forward

    def _run(self) -> None:
        """The pass's work, on the static input; its output into the static output."""
        with torch.no_grad():
            out = self.model(self.inputs[0])
            if not isinstance(out, Tensor):
                raise CaptureError(f"the model's closing must return a tensor, got "
                                   f"{type(out).__name__}")
            self.output = keep_static(self.output, out)
        self._keep_history()

    def _hold(self, captured: bool) -> None:
        """The forward passes without gradients; their solvers stay, with their states
        (`Passes.set_captured_no_grad`)."""
        self.model._passes.set_captured_no_grad(captured)


def keep_static(static: Tensor | None, value: Tensor) -> Tensor:
    """`value` copied into the static tensor that holds it from run to run (made at the
    first run, and again should the shape or dtype change, as only an eager run can)."""
    value = value.detach()
    if static is None or static.shape != value.shape or static.dtype != value.dtype:
        return value.clone()
    return static.copy_(value)


def _draws(model: LayerParallel) -> bool:
    """Whether the step module draws random numbers in training: a keyed dropout of p > 0,
    or torch's generator (found at the first training pass)."""
    layers = model.layers
    return layers.keyed_random or layers.torch_random


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """On CUDA: torch's optimizers with a `capturable` option keep their step count on the
    host unless it is set, which a graph cannot update."""
    for group in optimizer.param_groups:
        if group.get("capturable") is False:
            name = type(optimizer).__name__
            raise CaptureError(
                f"torch's {name} runs inside a CUDA graph only with capturable=True (its "
                f"step count then stays on the device): build it as {name}(..., "
                "capturable=True)")
