"""`CapturedStep`: a whole layer-parallel training step (forward solve, loss, adjoint solve,
parameter gradients, optimizer update) on static buffers and without host reads, captured
as one CUDA graph on a one-rank CUDA model and replayed, run eagerly elsewhere.

What makes the step capturable lives where the work does: solves of a fixed cycle count
whose residual norms stay on the device (`mgrit.core.device_history`, `Solver.captured`),
adjoint steps that do not look for all-zero cotangents (`AdjointPropagator.skip_zero_rows`),
both switched on for training's passes by `Passes.set_captured`. This module checks what
cannot be captured, before any capture, and runs the stages of a step: an eager first step
that builds the solvers and the optimizer's state, a second under the host-read guard
(`capture_guard`), then the capture and its replays (docs/training.md, "Captured steps").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import Tensor

from ..core.device_history import check_norms
from ..execute import CudaCapture
from .capture_guard import HostSyncError, culprit, host_reads_forbidden
from .controller.control import Controller
from .layer_parallel import LayerParallel

PASSES = ("forward", "backward")


class CaptureError(ValueError):
    """The model, optimizer or settings cannot run as a captured step; says why and what
    to change."""


class CapturedStep:
    """`step(x, y)` = one training step of `model` on the batch (x, y): zero the gradients,
    `loss_fn(model(x), y).backward()`, `optimizer.step()`; returns the loss, a tensor that
    the next step overwrites.

    Every step runs on the same storage: the batch is copied into static inputs shaped like
    `example_input` and `example_target` (a batch of another shape is refused), states,
    gradients and the optimizer's state are made by the first step and written in place
    after. Both solves run their `max_iter` cycles (tol=0 is required) and keep their
    residual norms on the device: `history()` returns them as tensors, `stats()` reads them.
    With `check` (default) every step ends with one host read of those norms, which raises
    `DivergenceError` naming the pass and cycle of a NaN or growing residual; without it,
    call `check()` when convenient.

    On CUDA with one rank the third step is captured as one CUDA graph and every later step
    replays it; the first two run eagerly (the second under a guard that names any module
    reading a tensor on the host). Elsewhere (a CPU, several ranks, data-parallel replicas)
    the same static-buffer step runs eagerly. `set_solvers` between steps is seen at the
    next step, which starts the stages again with the new solvers. With `controller` (a
    `mgrit.nn.Controller` of the same model) every step ends with its `after_step`: its
    probes run eagerly, outside any graph, at the updated weights, and a change of settings
    is captured again at the next steps. While a
    CapturedStep holds the model its passes with gradients are captured solves; `close()`
    gives it back to eager training.
    """

    def __init__(self, model: LayerParallel, loss_fn: Callable[[Tensor, Tensor], Tensor],
                 optimizer: torch.optim.Optimizer, example_input: Tensor,
                 example_target: Tensor, check: bool = True,
                 controller: Controller | None = None) -> None:
        if not isinstance(model, LayerParallel):
            raise TypeError(f"model must be a mgrit.nn.LayerParallel, got "
                            f"{type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        for name, value in (("example_input", example_input),
                            ("example_target", example_target)):
            if not isinstance(value, Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
        if controller is not None:
            if not isinstance(controller, Controller):
                raise TypeError(f"controller must be a mgrit.nn.Controller, got "
                                f"{type(controller).__name__}")
            if controller.model is not model:
                raise ValueError("the controller watches another model than this step's: "
                                 "make it with Controller(model) for the same model")
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.controller = controller
        self.check_each_step = bool(check)
        self.device = example_input.device
        # captured as one graph: a CUDA model on one rank without replicas, whose messages
        # (there are none) need no host between them
        self.graphs = (self.device.type == "cuda" and model.comm.size == 1
                       and model.data_comm is None)
        self._check_settings()
        if self.device.type == "cuda":
            _check_optimizer(optimizer)
        self.inputs = (example_input.detach().clone(), example_target.detach().clone())
        self.loss: Tensor | None = None
        self._history: dict[str, Tensor] = {}
        self._initial: dict[str, Any] = {}
        self._key: tuple | None = None
        self._stage = 0
        self._graph: Any = None
        # warm-up runs and captures on one side stream (`CudaCapture`, or a stand-in with
        # its `warm_up` and `capture`)
        self._capturer: Any = CudaCapture()
        self.steps = 0
        self.captures = 0
        model._passes.set_captured(True)

    # checks -----------------------------------------------------------------------------
    def _settings(self) -> tuple:
        """What a capture is valid for: training's passes and their options."""
        model = self.model
        return (id(model._passes), model.training,
                *(tuple(sorted(cfg.describe().items()))
                  for cfg in (model.forward_config, model.backward_config)))

    def _check_settings(self) -> None:
        model = self.model
        if not model.training:
            raise CaptureError("a captured step is a training step: call model.train() "
                               "before it")
        if model._held_draw_step is not None:
            raise CaptureError("a captured step cannot run inside model.probing(): probes "
                               "run eagerly, after the step")
        for kind in PASSES:
            cfg = getattr(model, f"{kind}_config")
            if cfg.tol != 0.0:
                raise CaptureError(
                    f"the {kind} solve has tol={cfg.tol}: a tolerance stops a solve at a "
                    "residual read on the host after every cycle, which a CUDA graph cannot "
                    f"do; use tol=0 (max_iter={cfg.max_iter} cycles, the residual history "
                    "is read after the step)")
            if cfg.agglomerate and model.comm.size > 1:
                raise CaptureError(
                    f"the {kind} solve has agglomerate={cfg.agglomerate}: its gathered coarse "
                    "levels fetch layers (and forward states) with a collective on the host "
                    "before every solve, which a captured step cannot make; use "
                    "agglomerate=0")
            if cfg.cuda_graphs and self.graphs:
                raise CaptureError(
                    f"the {kind} solve has cuda_graphs=True, which captures relaxation "
                    "sweeps in graphs of their own; a captured step holds the whole step in "
                    "one graph, and graphs do not nest: use cuda_graphs=False")
        if _draws(model):
            raise CaptureError(
                "the step module draws random numbers (dropout): its keys are made on the "
                "host for every step, which a replayed graph would repeat; train it without "
                "CapturedStep")

    def _check_batch(self, x: Tensor, y: Tensor) -> None:
        for name, given, static in (("input", x, self.inputs[0]),
                                    ("target", y, self.inputs[1])):
            if not isinstance(given, Tensor):
                raise TypeError(f"the {name} must be a tensor, got {type(given).__name__}")
            if given.shape != static.shape or given.dtype != static.dtype:
                raise CaptureError(
                    f"the {name} has shape {tuple(given.shape)} and dtype {given.dtype}; "
                    f"this step was built for shape {tuple(static.shape)} and dtype "
                    f"{static.dtype} (its static buffers, and a graph, have one shape): "
                    "make another CapturedStep for the other shape")

    # the step ---------------------------------------------------------------------------
    def step(self, x: Tensor, y: Tensor) -> Tensor:
        """One training step on (x, y); returns the loss (a tensor, overwritten by the next
        step)."""
        self._check_batch(x, y)
        key = self._settings()
        if key != self._key:
            # first step, or new solver settings: the solvers are new, any graph is stale
            self._check_settings()
            self._key, self._stage, self._graph = key, 0, None
        self.inputs[0].copy_(x)
        self.inputs[1].copy_(y)
        if self._graph is not None:
            self._graph.replay()
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
        self.steps += 1
        if self.check_each_step:
            self.check()
        if self.controller is not None:
            # after the step, outside any graph: a probe, and a change of settings that
            # the next step captures again
            self.controller.after_step(
                lambda: self.loss_fn(self.model(self.inputs[0]), self.inputs[1]),
                {kind: {"residuals": self._history[kind],
                        "initial_norm": self._initial[kind]} for kind in PASSES})
        return self.loss

    def _run(self) -> None:
        """The step's work, on the static inputs; the loss into the static loss."""
        self.optimizer.zero_grad(set_to_none=False)
        loss = self.loss_fn(self.model(self.inputs[0]), self.inputs[1])
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            got = f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss)
            raise CaptureError(f"loss_fn must return a scalar tensor, got {got}")
        loss.backward()
        self.optimizer.step()
        if self.loss is None:
            self.loss = loss.detach().clone()
        else:
            self.loss.copy_(loss.detach())
        stats = self.model.stats
        # static tensors of a captured step, which a replay writes again
        self._history = {kind: stats[kind]["residuals"] for kind in PASSES}
        self._initial = {kind: stats[kind]["initial_norm"] for kind in PASSES}

    def _guarded_run(self) -> None:
        """`_run` under the host-read guard; a read is refused naming where it was made."""
        try:
            with self.guarded():
                self._run()
        except HostSyncError as err:
            raise CaptureError(
                f"the training step reads a tensor on the host ({err}) in "
                f"{culprit(err, self.model)}: a captured step cannot (a graph would keep "
                "the value read at capture and the read waits for the device); keep the "
                "value on the device (torch.where instead of if, no .item())") from None

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """Host reads raise inside (`host_reads_forbidden`), but for the step counts that
        torch's optimizers keep on the host on a CPU (capturable=True is for CUDA alone;
        on CUDA a host step count is refused before any step)."""
        counts = [state["step"] for state in self.optimizer.state.values()
                  if isinstance(state.get("step"), Tensor)
                  and state["step"].device.type == "cpu"]
        with host_reads_forbidden(counts):
            yield

    def _warm(self, run: Callable[[], None]) -> None:
        """An eager step; before a capture on the stream that captures, as capturing asks
        (libraries make per-stream handles at their first use)."""
        if self.graphs:
            self._capturer.warm_up(self.inputs[0], run)
        else:
            run()

    def _capture(self) -> None:
        """Capture the step as one CUDA graph and replay it (capturing runs nothing)."""
        try:
            graph = self._capturer.capture(self.inputs[0], self._run)
        except RuntimeError as err:
            raise CaptureError(f"capturing the training step failed ({err}): something in "
                               "it copies between host and device or synchronises") from err
        self._graph = graph
        self.captures += 1
        graph.replay()

    def close(self) -> None:
        """Give the model back to eager training: its passes with gradients are ordinary
        solves again (a tolerance allowed, float residual lists in `model.stats`), the
        graph is dropped; the solvers are built again, warm from where these left off."""
        self.model._passes.set_captured(False)
        self._graph, self._key = None, None

    # residual histories -----------------------------------------------------------------
    def history(self) -> dict[str, Tensor]:
        """The latest step's residual norms per pass ("forward", "backward"), float64
        tensors on the device (views of static buffers: the next step overwrites them)."""
        return dict(self._history)

    def stats(self) -> dict[str, dict[str, Any]]:
        """The latest step's cycles and residual norms per pass, read on the host."""
        return {kind: {"iterations": len(norms), "residuals": norms.tolist()}
                for kind, norms in self._history.items()}

    def check(self) -> None:
        """Read the latest step's residual norms (one host read per pass) and raise
        `DivergenceError` at a NaN/Inf one or one past `divergence_factor` times the
        first, naming the pass and cycle."""
        for kind, norms in self._history.items():
            cfg = getattr(self.model, f"{kind}_config")
            check_norms(norms, cfg.divergence_factor, kind)


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
