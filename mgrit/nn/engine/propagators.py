"""The propagators of a residual network on a rank's `LayerStack`.

Forward:  Phi_n(u) = u + dt * f(u; theta_n)
Adjoint:  on the reversed grid, w -> w + dt * (df/du)(u_p; theta_p)^T w, with p the
          forward point where the corresponding forward step starts.

Both compute through a step strategy (`mgrit.nn.engine.module_strategy`) chosen once per solve
for their states' shape, dtype and device; what is theirs is the bookkeeping around it: which layer a
step uses, the op outputs the forward pass keeps for the adjoint, the adjoint's skipping of
zero cotangents and the parameter cotangents of its final fine sweep.
"""

from __future__ import annotations

import operator
from typing import Callable, Hashable

import torch
from torch import Tensor

from ...core.propagator import Step, StepBatch
from ...execute import write_result
from ...kernels.choice import compiled_phases
from ...kernels.contract import has_phases
from ...kernels.strategies import Kept, Tensors
from .stack import LayerStack
from .module_strategy import StepSelection


def _nonzero_rows(x: Tensor) -> list[bool]:
    """Whether each entry of x (along its first dimension) holds anything but zeros; NaN
    counts as non-zero. On large entries a maximum and a minimum beat `any`, which turns
    every element into a bool first; on small ones `any`, one call, is cheaper. The answer
    comes back as one list: reducing it with more tensor calls would cost more than the
    check (docs/performance.md has the measurements)."""
    flat = x.reshape(len(x), -1)
    if flat.shape[1] < 16384:
        return flat.any(dim=1).tolist()
    return ((flat.amax(dim=1) != 0) | (flat.amin(dim=1) != 0)).tolist()


def _is_nonzero(x: Tensor) -> bool:
    """Whether one state holds anything but zeros (NaN counts): the sequential march's
    check, two calls for a small state rather than a batch of one."""
    if x.numel() < 16384:
        return bool(x.any())
    return _nonzero_rows(x[None])[0]


def _program_key(kernels: object, method: str, stack: LayerStack, values: int
                 ) -> tuple[Hashable | None, int]:
    """(key, most independent steps) of a solve's compiled phases: the parameters' storage
    and the strategy, where compiled phases may run (`compiled_phases`) and the strategy
    is a `PhaseStrategy` (`method`: the phase that asks); (None, 0) otherwise."""
    if not (compiled_phases() and has_phases(kernels)):
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

    def begin(self) -> None:
        """A new solve: the step strategy for it (whether native kernels may run is read
        here, once), and whether its steps draw random numbers (keyed per layer)."""
        self.kernels = self._selection.current()
        self._random = self.stack.random
        self._program_key, self._max_parallel = _program_key(self.kernels, "program",
                                                             self.stack, self._values)
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


class AdjointPropagator:
    """The adjoint on the reversed grid: reversed step k of a level with stride M is the
    transposed linearisation of the forward step from point p = N - (k + 1) M over M fine
    steps, using layer p at the forward state u_p.

    While `final_sweep(True)` is on, level-0 steps (the final fine-level sweep of the adjoint
    and its residual: one VJP per layer, with final values) also give the layer's parameter
    gradient, dt (df/dtheta)(u_p)^T w, from the same forward pass; `gradients` collects them
    batch by batch.
    """

    def __init__(self, stack: LayerStack, num_steps: int, strides: list[int], states: Tensor,
                 offset: int, outputs: dict[int, Kept] | None = None) -> None:
        self.stack = stack
        self.outputs = outputs      # the forward pass's kept op outputs at `states`
        self.num_steps = num_steps
        self.strides = strides
        self.states = states        # forward states: row i holds point offset + i
        self.offset = offset
        self._selection = StepSelection(stack, states[0])
        self.kernels = self._selection.current()     # the step strategy of this solve
        self.recording = False
        # (layers, parameter cotangents of that batch, dt), in the order they were taken;
        # a later entry for a layer replaces an earlier one
        self.gradients: list[tuple[list[int], Tensors, float]] = []
        # (first point, stride, count) of a batch -> [its points, their forward states, the
        # op outputs there (None until its first VJP)]: all fixed for a whole backward
        # solve, so gathered once
        self._gathered: dict[tuple[int, int, int], list] = {}
        # op outputs at a forward point that the forward pass did not keep, computed at their
        # first use in this backward solve (same form as `outputs`)
        self._computed: dict[int, Kept] = {}
        self._random = False
        self._values = states[0].numel()
        self._program_key: Hashable | None = None
        self._record_key: Hashable | None = None
        self._max_parallel = 0

    def begin(self) -> None:
        """A new backward solve: new forward states, no gradients yet, the step strategy
        for it and whether its steps draw random numbers (with the forward pass's keys)."""
        self.gradients = []
        self._gathered.clear()
        self._computed.clear()
        self.kernels = self._selection.current()
        self._random = self.stack.random
        self._program_key, self._max_parallel = _program_key(self.kernels, "vjp_program",
                                                             self.stack, self._values)
        self._record_key = (None if self._program_key is None
                            else (*self._program_key, "record"))

    def program_key(self, level: int, parallel: int) -> Hashable | None:
        """As `NetworkPropagator.program_key`; the final fine sweep's phases, which record
        parameter cotangents, have a key of their own."""
        if parallel > self._max_parallel or self._random or self.stack.context:
            return None
        return self._record_key if self.recording and level == 0 else self._program_key

    def step_program(self, steps: list[Step], rows: list[tuple[Tensor, Tensor, Tensor | None]],
                     parallel: int) -> Callable[[], None] | None:
        """out = g + (adjoint step)(w) for every (w, out, g) of `rows` with its step, in
        order, as one compiled call from the forward's op outputs (in the final fine sweep
        also recording the parameter cotangents, `gradients`); None where the strategy has
        none for these operands."""
        phase = _AdjointPhase(self, steps, rows, self.recording and steps[0].level == 0)
        return phase if phase.program is not None else None

    def final_sweep(self, active: bool) -> None:
        """The solver's hook around its final fine sweep: record parameter cotangents."""
        self.recording = active

    def _layer_point(self, s: Step) -> int:
        """The forward point p whose layer and state step s of the adjoint uses."""
        return self.num_steps - s.fine_index - self.strides[s.level]

    # op outputs of the forward steps ----------------------------------------------------
    def _kept(self, p: int) -> Kept | None:
        """The op outputs at forward point p with layer p, where every adjoint step that
        uses layer p linearises, whatever its level: kept by the forward pass or computed
        earlier in this backward solve; None if neither."""
        kept = self.outputs.get(p) if self.outputs else None
        return kept if kept is not None else self._computed.get(p)

    def _single_kept(self, p: int, t: Tensors) -> Kept:
        """The op outputs of layer p at forward state p: kept, or computed now and kept."""
        kept = self._kept(p)
        if kept is None:
            kept = self._computed[p] = self.kernels.single_values(
                p, t, self.states[p - self.offset])
        return kept

    def _batch_values(self, t: Tensors, us: Tensor, layers: list[int], batch: list | None
                      ) -> list:
        """A batch's op outputs, as the strategy's `vjp` reads them: kept in its `_gathered`
        entry, or gathered from kept ones (computed, and kept, where a layer has none)."""
        values = batch[2] if batch is not None else None
        if values is None:
            kept = [self._kept(p) for p in layers]
            if any(k is None for k in kept):
                outputs = self.kernels.values(t, us)
                kept = [(outputs, i) for i in range(len(layers))]
                self._computed.update(zip(layers, kept))
            values = self.kernels.gather(us, kept)
            if batch is not None:
                batch[2] = values
        return values

    # steps ------------------------------------------------------------------------------
    def _vjp(self, t: Tensors, us: Tensor, ws: Tensor, layers: list[int], level: int,
             dt: float, batch: list | None = None) -> Tensor:
        """ws + dt (df/du)^T ws for a batch (`batch`: its entry of `_gathered`, where the op
        outputs are kept for the next call), recording parameter cotangents in the final
        fine sweep. The adjoint is linear in w, so entries whose w is exactly zero (much of
        a first cycle from a zero guess) map to zero and are skipped: the result is the same
        to the bit."""
        kernels = self.kernels
        record = self.recording and level == 0
        if not kernels.skips_zeros:
            nonzero = _nonzero_rows(ws)
            if not all(nonzero):
                return self._vjp_nonzero(t, us, ws, layers, level, dt, nonzero, record)
        values = (self._batch_values(t, us, layers, batch) if kernels.wants_values(record)
                  else None)
        if self._random:
            with self.stack.drawing(layers):
                out, dp = kernels.vjp(t, us, ws, dt, values, record)
        else:
            out, dp = kernels.vjp(t, us, ws, dt, values, record)
        if record:
            self.gradients.append((layers, dp, dt))
        return out

    def _vjp_nonzero(self, t: Tensors, us: Tensor, ws: Tensor, layers: list[int], level: int,
                     dt: float, nonzero: list[bool], record: bool) -> Tensor:
        """`_vjp` of the entries that are not all zeros; the others map to zero."""
        out = torch.zeros_like(ws)
        if record:
            zeros = {k: torch.zeros_like(v) for k, v in t.items() if k in self.stack.names}
            self.gradients.append((layers, zeros, dt))
        keep = [i for i, nz in enumerate(nonzero) if nz]
        if len(keep) == 1 and not record and self.kernels.keeps_values:
            # a lone non-zero entry (the first cycle's front on the rank that starts the
            # backward solve) takes the single-step VJP, not a batch of one
            i = keep[0]
            p = layers[i]
            views = self.stack.views(p)
            self.kernels.vjp_single_into(p, views, ws[i], dt, out[i], None,
                                       self._single_kept(p, views))
        elif keep:
            index = torch.tensor(keep, device=ws.device)
            out[index] = self._vjp({k: v.index_select(0, index) for k, v in t.items()},
                                   us.index_select(0, index), ws.index_select(0, index),
                                   [layers[i] for i in keep], level, dt)
        return out

    def step(self, w: Tensor, s: Step) -> Tensor:
        p = self._layer_point(s)
        u = self.states[p - self.offset]
        if (self.kernels.keeps_values or (self.recording and s.level == 0)
                or not _is_nonzero(w)):
            return self._vjp(self.stack.rows(p, 1, 1), u[None], w[None], [p], s.level,
                             s.dt)[0]
        if self._random:
            with self.stack.drawing(p):
                return self.kernels.vjp_single(p, u, w, s.dt)
        return self.kernels.vjp_single(p, u, w, s.dt)

    def step_into(self, w: Tensor, s: Step, out: Tensor, g: Tensor | None) -> None:
        """out = g + (this step's adjoint)(w) (g None: zero), in place, one layer with plain
        calls from its kept op outputs: the sequential march takes one step at a time."""
        kernels = self.kernels
        if not kernels.keeps_values:
            write_result(out, self.step(w, s), g)
            return
        p = self._layer_point(s)
        views = self.stack.views(p)
        if self.recording and s.level == 0:
            u = self.states[p - self.offset]
            dp = kernels.record_single_into(p, views, u, w, s.dt, out, g,
                                            lambda: self._single_kept(p, views))
            if dp is None:
                write_result(out, self.step(w, s), g)
            else:
                self.gradients.append(([p], dp, s.dt))
            return
        kept = self._kept(p)
        if kept is not None and kernels.skips_zeros:
            # with the forward's outputs at hand the kernel makes the zero check itself
            kernels.vjp_single_into(p, views, w, s.dt, out, g, kept)
            return
        if not _is_nonzero(w):
            if g is None:
                out.zero_()
            else:
                out.copy_(g)
            return
        kernels.vjp_single_into(p, views, w, s.dt, out, g,
                                kept if kept is not None else self._single_kept(p, views))

    def step_batch(self, ws: Tensor, steps: StepBatch) -> Tensor:
        m = self.strides[steps.level]
        first = self.num_steps - steps.start * m - m
        stride = -steps.stride * m
        key = (first, stride, steps.count)
        batch = self._gathered.get(key)
        if batch is None:
            points = torch.arange(first, first + stride * steps.count, stride)
            us = self.states.index_select(0, (points - self.offset).to(self.states.device))
            batch = self._gathered[key] = [points.tolist(), us, None]
        tensors = self.stack.rows(first, stride, steps.count)
        return self._vjp(tensors, batch[1], ws, batch[0], steps.level, steps.dt, batch)


class _AdjointPhase:
    """A compiled phase of adjoint steps and the op outputs it reads: those the forward
    pass kept (or that the backward solve computed), looked up again at every run. The
    forward's native strategy keeps them in the same tensors pass after pass, so a phase is
    compiled once; where one is a new tensor, the phase is compiled again before it runs."""

    __slots__ = ("prop", "steps", "rows", "points", "sources", "entries", "program",
                 "record", "cotangents", "layers")

    def __init__(self, prop: AdjointPropagator, steps: list[Step],
                 rows: list[tuple[Tensor, Tensor, Tensor | None]], record: bool) -> None:
        self.prop, self.steps, self.rows = prop, steps, rows
        self.points = [prop._layer_point(s) for s in steps]
        self.sources: list[tuple[object, int]] = []
        # the forward's entries (`outputs`) the last run found its sources in: while every
        # one is still there, no source can have changed
        self.entries: list[Kept | None] | None = None
        self.program: Callable[[], None] | None = None
        self.record = record
        # the parameter cotangents a recording phase writes, one row per step, in the
        # form `gradients` takes a batch's (written again at every run: the consumer of a
        # backward solve's gradients reads them before the next one begins), and the layers
        # of its rows: in increasing order where the steps take them in decreasing order (as
        # the adjoint does), so that the gradients are assembled without reversing them
        self.cotangents: dict[str, Tensor] | None = None
        descending = all(a > b for a, b in zip(self.points, self.points[1:]))
        self.layers = self.points[::-1] if descending else self.points
        self._compile()

    def _kept_tanh(self) -> list[Tensor]:
        """Each step's kept tanh (computed now where none is kept), noting where it was
        read from (`sources`, what every run checks)."""
        prop = self.prop
        ys, self.sources = [], []
        for p in self.points:
            outputs, k = prop._single_kept(p, prop.stack.views(p))
            ys.append(outputs[1][k])
            self.sources.append((outputs[1], k))
        return ys

    def _compile(self) -> None:
        prop = self.prop
        ys = self._kept_tanh()
        tensors = [prop.stack.views(p) for p in self.points]
        record = None
        if self.record:
            weight, bias = prop.kernels.parameter_names()
            w, b = tensors[0][weight], tensors[0][bias]
            count = len(self.points)
            gw, gb = w.new_empty((count, *w.shape)), b.new_empty((count, *b.shape))
            self.cotangents = {weight: gw, bias: gb}
            # step i writes row i, or row count-1-i where the rows go in layer order
            order = range(count) if self.layers is self.points else range(count - 1, -1, -1)
            record = ([prop.states[p - prop.offset] for p in self.points],
                      [gw[r] for r in order], [gb[r] for r in order])
        self.program = prop.kernels.vjp_program(tensors, ys, self.rows, self.steps[0].dt,
                                                record)

    def _refresh(self) -> None:
        """New kept outputs (torch's strategy, which computes large forward batches, keeps
        them in new tensors every pass): their addresses go into the program's table, or
        the phase is compiled again where one does not suit it."""
        ys = self._kept_tanh()
        if self.program is None or not self.program.set_operand(2, ys):
            self._compile()

    def _check(self, outputs: dict[int, Kept]) -> None:
        """Refresh where a step's kept tanh is no longer its source; note the entries."""
        computed = self.prop._computed
        for p, (source, k) in zip(self.points, self.sources):
            now = outputs.get(p) or computed.get(p)     # `AdjointPropagator._kept`, inlined
            if now is None or now[0][1] is not source or now[1] != k:
                self._refresh()
                break
        entries = [outputs.get(p) for p in self.points]
        # a tanh the backward solve computed (`_computed`, new at every solve) is not in the
        # forward's entries: such a phase checks step by step at every run
        self.entries = None if any(e is None for e in entries) else entries

    def __call__(self) -> None:
        outputs = self.prop.outputs or {}
        # the same entry objects as at the last run (the native strategy's, pass after
        # pass): checked at C speed, where a loop over the points in Python would cost
        # more than their arithmetic
        entries = self.entries
        if entries is None or not all(map(operator.is_, map(outputs.get, self.points),
                                          entries)):
            self._check(outputs)
        if self.program is None:     # the outputs' layout no longer suits the kernels
            for s, (w, out, g) in zip(self.steps, self.rows):
                self.prop.step_into(w, s, out, g)
            return
        self.program()
        if self.record:
            self.prop.gradients.append((self.layers, self.cotangents, self.steps[0].dt))
