"""The forward propagator of a residual network on a rank's `LayerStack`, and what it
shares with the adjoint's (`adjoint`): the zero checks and the keys of compiled phases.

Forward:  Phi_n(u) = u + dt * f(u; theta_n)
Adjoint:  on the reversed grid, w -> w + dt * (df/du)(u_p; theta_p)^T w, with p the
          forward point where the corresponding forward step starts.

Both compute through a step strategy (`mgrit.nn.engine.module_strategy`) chosen once per
solve for their states' shape, dtype and device; what is theirs is the bookkeeping around
it: which layer a step uses, the op outputs the forward pass keeps for the adjoint, the
adjoint's skipping of zero cotangents and the parameter cotangents of its final fine sweep.
"""


from __future__ import annotations

from typing import Callable, Hashable

import torch
from torch import Tensor

from ...core.propagator import Step, StepBatch
from ...execute import write_result
from ...kernels.choice import compiled_phases
from ...kernels.contract import has_phases
from ...kernels.strategies import Kept, Tensors
from .fetch import LayerFetch
from .module_strategy import StepSelection
from .stack import LayerStack


def nonzero_rows(x: Tensor) -> list[bool]:
    """Whether each entry of x (along its first dimension) holds anything but zeros; NaN
    counts as non-zero. On large entries a maximum and a minimum beat `any`, which turns
    every element into a bool first; on small ones `any`, one call, is cheaper. The answer
    comes back as one list: reducing it with more tensor calls would cost more than the
    check (docs/performance.md has the measurements)."""
    flat = x.reshape(len(x), -1)
    if flat.shape[1] < 16384:
        return flat.any(dim=1).tolist()
    return ((flat.amax(dim=1) != 0) | (flat.amin(dim=1) != 0)).tolist()


def is_nonzero(x: Tensor) -> bool:
    """Whether one state holds anything but zeros (NaN counts): the sequential march's
    check, two calls for a small state rather than a batch of one."""
    if x.numel() < 16384:
        return bool(x.any())
    return nonzero_rows(x[None])[0]


def program_key(kernels: object, method: str, stack: LayerStack, values: int, backend: str
                ) -> tuple[Hashable | None, int]:
    """(key, most independent steps) of a solve's compiled phases: the parameters' storage
    and the strategy, where the resolved kernels choice `backend` lets compiled phases
    run (`compiled_phases`) and the strategy
    is a `PhaseStrategy` (`method`: the phase that asks); (None, 0) otherwise."""
    if not (compiled_phases(backend) and has_phases(kernels)):
        return None, 0
    return ((stack.storage_key(), id(kernels)),
            kernels.program_parallel(values, method == "vjp_program"))



class NetworkPropagator:
    """Phi(u) = u + dt * f(u; theta_n): the forward steps of the residual network for
    states like `like`. Coarse steps use the layer where they start.

    With `keep_outputs`, the final fine-level sweep of every cycle (`final_sweep`) keeps
    each layer's op outputs, the values that the adjoint's fine-level VJPs would otherwise
    compute again: the sweep's steps start from the final states, where the backward pass
    linearises. `outputs` maps a layer to (outputs of its batch, its index there).
    """

    local_steps = True      # a coarse step needs its layer, held here or as a ghost

    def __init__(self, stack: LayerStack, like: Tensor, keep_outputs: bool = False) -> None:
        self.stack = stack
        self._selection = StepSelection(stack, like)
        self.kernels = self._selection.current()     # the step strategy of this solve
        self.outputs: dict[int, Kept] | None = (
            {} if keep_outputs and self.kernels.keeps_values else None)
        self._keeping = False
        self._random = False
        self._values = like.numel()
        self._program_key: Hashable | None = None
        self._keep_key: Hashable | None = None
        self._max_parallel = 0
        # the layers of gathered coarse levels' steps (`gather_steps`), fetched per solve
        self._fetch: LayerFetch | None = None

    def gather_steps(self, grids: list, comm: object) -> None:
        """Every rank takes every step of `grids`, the solver's gathered coarse levels: the
        layers where those steps start come to every rank before each solve (`begin`)."""
        layers = sorted({j * g.stride for g in grids for j in range(g.num_steps)})
        self._fetch = LayerFetch.of(self.stack)
        self._fetch.add(layers, comm)

    @property
    def fetches(self) -> bool:
        """Whether each solve begins by fetching the layers of gathered levels."""
        return self._fetch is not None

    def begin(self) -> None:
        """A new solve: the gathered levels' layers (a collective), the step strategy for it
        (whether native kernels may run is read here, once), and whether its steps draw
        random numbers (keyed per layer)."""
        if self._fetch is not None:
            self._fetch.run()
        self.kernels = self._selection.current()
        self._random = self.stack.random
        self._program_key, self._max_parallel = program_key(
            self.kernels, "program", self.stack, self._values, self._selection.backend)
        self._keep_key = (None if self._program_key is None or self.outputs is None
                          or not has_phases(self.kernels)
                          else (*self._program_key, "keep"))

    def program_key(self, level: int, parallel: int) -> Hashable | None:
        """What the solver's compiled phases of `level` (`step_program`) were built for:
        the parameters' storage and the strategy of this solve, and whether the phase
        keeps op outputs (the final fine sweep); None where phases run step by step (no
        native phase kernels, too many independent steps for them, random draws, context
        inputs)."""
        if parallel > self._max_parallel or self._random or self.stack.context:
            return None
        return self._keep_key if self._keeping and level == 0 else self._program_key

    def step_program(self, steps: list[Step], rows: list[tuple[Tensor, Tensor, Tensor | None]],
                     parallel: int) -> Callable[[], None] | None:
        """out = g + Phi(u) for every (u, out, g) of `rows` with its step, in order, as one
        compiled call; None where the strategy has none for these operands. In the final
        fine sweep the call also keeps the steps' op outputs for the adjoint."""
        views = self.stack.views
        tensors = [views(s.fine_index) for s in steps]
        if not (self._keeping and steps[0].level == 0):
            return self.kernels.program(tensors, rows, steps[0].dt)
        made = self.kernels.keep_program([s.fine_index for s in steps], tensors, rows,
                                         steps[0].dt)
        if made is None:
            return None
        program, kept = made
        outputs = self.outputs

        def run() -> None:
            program()
            outputs.update(kept)
        return run

    def final_sweep(self, active: bool) -> None:
        """The solver's hook around its final fine sweep: keep outputs while it runs."""
        if self.outputs is not None:
            if active:
                self.outputs.clear()
            self._keeping = active

    def graph_key(self) -> tuple[int, ...] | None:
        """For CUDA graphs of sweeps (`SweepGraphs`): the parameters' storage, or None while
        the steps keep their outputs (Python bookkeeping that a replay would skip)."""
        if self._keeping or self._random or self.stack.context:
            # keys and context tensors are new every pass: a replay would reuse old ones
            return None
        return self.stack.storage_key()

    def step(self, u: Tensor, s: Step) -> Tensor:
        n = s.fine_index
        if self._random:
            with self.stack.drawing(n):
                return self.kernels.step(n, self.stack.views(n), u, s.dt)
        return self.kernels.step(n, self.stack.views(n), u, s.dt)

    def step_into(self, u: Tensor, s: Step, out: Tensor, g: Tensor | None) -> None:
        """out = g + Phi(u) (g None: zero), written in place with few kernel calls: the
        sequential march takes one step at a time, where calls cost more than arithmetic."""
        n = s.fine_index
        kernels = self.kernels
        if not kernels.keeps_values:
            write_result(out, self.step(u, s), g)
            return
        kept = kernels.step_into(n, self.stack.views(n), u, s.dt, out, g,
                                 self._keeping and s.level == 0)
        if kept is not None:
            self.outputs[n] = kept

    def _rows(self, steps: StepBatch) -> Tensors:
        m = steps.level_stride
        return self.stack.rows(steps.start * m, steps.stride * m, steps.count)

    def _layers(self, steps: StepBatch) -> Tensor:
        m = steps.level_stride
        return torch.arange(steps.count) * (steps.stride * m) + steps.start * m

    def step_batch(self, states: Tensor, steps: StepBatch) -> Tensor:
        if self._keeping and steps.level == 0:
            out = torch.empty_like(states)
            self.step_batch_into(states, steps, out, None)
            return out
        if self._random:
            with self.stack.drawing(self._layers(steps)):
                return self.kernels.batch(self._rows(steps), states, steps.dt)
        return self.kernels.batch(self._rows(steps), states, steps.dt)

    def step_batch_into(self, states: Tensor, steps: StepBatch, out: Tensor,
                        g: Tensor | None) -> None:
        """out = g + Phi(states) for a batch (g None: zero), without a stacked temporary
        where the strategy writes layer by layer."""
        kernels = self.kernels
        if not kernels.keeps_values:
            write_result(out, self.step_batch(states, steps), g)
            return
        outputs = kernels.batch_into(self._rows(steps), states, steps.dt, out, g,
                                     self._keeping and steps.level == 0)
        if outputs is not None:
            for n in range(steps.count):
                self.outputs[steps.start + n * steps.stride] = (outputs, n)
