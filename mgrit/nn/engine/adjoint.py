"""The adjoint propagator of a residual network on a rank's `LayerStack`: on the reversed
grid, w -> w + dt * (df/du)(u_p; theta_p)^T w, with p the forward point where the
corresponding forward step starts. Its bookkeeping: the op outputs the forward pass kept
(or that this backward solve computed), the skipping of zero cotangents and the parameter
cotangents of the final fine sweep; its compiled phases are `adjoint_phase`'s."""

from __future__ import annotations

from typing import Callable, Hashable, NamedTuple

import torch
from torch import Tensor

from ...core.propagator import Step, StepBatch
from ...execute import write_result
from ...kernels.strategies import Kept, Tensors
from .adjoint_phase import AdjointPhase
from .fetch import LayerFetch, StateFetch
from .module_strategy import StepSelection
from .propagators import is_nonzero, nonzero_rows, program_key
from .stack import LayerStack


class _HeldValues(NamedTuple):
    """What `AdjointPropagator._values_at_fetched` reads and writes at every solve."""

    made_for: tuple       # the layer buffer, state buffer and strategy they were made for
    layers: Tensors       # the fetched layers, stacked (views of the layer buffer)
    states: Tensor        # the fetched states, stacked (a view of the state buffer)
    values: list | None   # the op outputs, written again at every solve
    entries: dict | None  # point -> its kept entry in `values`


class AdjointPropagator:
    """The adjoint on the reversed grid: reversed step k of a level with stride M is the
    transposed linearisation of the forward step from point p = N - (k + 1) M over M fine
    steps, using layer p at the forward state u_p.

    While `final_sweep(True)` is on, level-0 steps (the final fine-level sweep of the adjoint
    and its residual: one VJP per layer, with final values) also give the layer's parameter
    gradient, dt (df/dtheta)(u_p)^T w, from the same forward pass; `gradients` collects them
    batch by batch.
    """

    local_steps = True      # a step needs the forward state that this rank's solve left

    def __init__(self, stack: LayerStack, num_steps: int, strides: list[int], states: Tensor,
                 offset: int, outputs: dict[int, Kept] | None = None,
                 forward_fetches: bool = False) -> None:
        self.stack = stack
        self.outputs = outputs      # the forward pass's kept op outputs at `states`
        self.num_steps = num_steps
        self.strides = strides
        self.states = states        # forward states: row i holds point offset + i
        self.offset = offset
        self._count = len(states)
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
        # whether all-zero cotangents are found (a host read) and skipped; a captured
        # solve computes them like any other
        self.skip_zero_rows = True
        # the layers and forward states of gathered coarse levels' steps (`gather_steps`),
        # fetched per solve
        self._fetch: tuple[LayerFetch, StateFetch] | None = None
        # what `_values_at_fetched` reads and writes at every solve
        self._held_values: _HeldValues | None = None
        # whether the forward solve of these states fetches layers for gathered levels
        # (then every layer this one's gathered levels need: `LayerFetch` is one per stack)
        self._forward_fetches = forward_fetches

    def gather_steps(self, grids: list, comm: object) -> None:
        """Every rank takes every step of `grids`, the solver's gathered coarse levels: the
        layers and forward states where those steps linearise come to every rank before
        each solve (`begin`)."""
        if self.states.is_complex():
            raise ValueError("Config(agglomerate > 0) in a layer-parallel network needs real "
                             "states; use agglomerate=0 with complex ones")
        n = self.num_steps
        points = sorted({n - (j + 1) * g.stride for g in grids for j in range(g.num_steps)})
        layers = LayerFetch.of(self.stack)
        layers.add(points, comm)
        self._fetch = (layers, StateFetch(points, comm))

    def _state(self, p: int) -> Tensor:
        """The forward state at point p: this rank's, or fetched for a gathered step."""
        i = p - self.offset
        if 0 <= i < self._count:
            return self.states[i]
        return self._fetch[1].states[p]

    def begin(self) -> None:
        """A new backward solve: new forward states (and the gathered levels' layers and
        states, a collective each), no gradients yet, the step strategy for it and whether
        its steps draw random numbers (with the forward pass's keys)."""
        if self._fetch is not None:
            layers, states = self._fetch
            # where the forward solve fetches layers, its fetch (the stack's one) brought
            # these too, unless they were added since; the parameters do not change
            # between the two passes
            if not (self._forward_fetches and layers.fresh):
                layers.run()
            states.run(self.states, self.offset)
        self.gradients = []
        self._gathered.clear()
        self._computed.clear()
        self.kernels = self._selection.current()
        self._random = self.stack.random
        self._program_key, self._max_parallel = program_key(
            self.kernels, "vjp_program", self.stack, self._values, self._selection.backend)
        self._record_key = (None if self._program_key is None
                            else (*self._program_key, "record"))
        if self._fetch is not None and self.kernels.keeps_values and not self._random:
            self._values_at_fetched()

    def _values_at_fetched(self) -> None:
        """The op outputs at the fetched points, in one batched call: every gathered step
        reads them, and a call per point would cost more than the gathered levels'
        arithmetic. The layers and states are read where the fetches left them (views of
        their buffers), and the outputs written into the same tensors at every solve where
        the strategy can: the compiled phases that read them by address then stay as they
        are. A point whose outputs the forward pass kept reads those (`_kept`)."""
        layers, fetched = self._fetch
        points = fetched.rows.keys
        made_for = (layers.rows.buffer, fetched.rows.buffer, self.kernels)
        held = self._held_values
        if held is None or any(a is not b for a, b in zip(held.made_for, made_for)):
            t, us = layers.stacked(points), fetched.stacked
            held = (None if t is None or us is None else
                    _HeldValues(made_for, t, us, None, None))
        if held is None:
            # the buffers do not serve as stacked tensors (another dtype): stacked copies
            views = [self.stack.views(p) for p in points]
            t = {k: torch.stack([v[k] for v in views]) for k in views[0]}
            us = torch.stack([self._state(p) for p in points])
        else:
            t, us = held.layers, held.states
        batch = getattr(self.kernels, "batch_values", None)
        values = None if batch is None else batch(t, us, None if held is None else held.values)
        if values is None:
            values, held = self.kernels.values(t, us), None
        elif held is not None and held.values is None:
            held = held._replace(values=values,
                                 entries={p: (values, i) for i, p in enumerate(points)})
        self._held_values = held
        self._computed.update(held.entries if held is not None else
                              {p: (values, i) for i, p in enumerate(points)})

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
        phase = AdjointPhase(self, steps, rows, self.recording and steps[0].level == 0)
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
            kept = self._computed[p] = self.kernels.single_values(p, t, self._state(p))
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
        if not kernels.skips_zeros and self.skip_zero_rows:
            nonzero = nonzero_rows(ws)
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
        u = self._state(p)
        if (self.kernels.keeps_values or (self.recording and s.level == 0)
                or (self.skip_zero_rows and not is_nonzero(w))):
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
        if self.skip_zero_rows and not is_nonzero(w):
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
            points = list(range(first, first + stride * steps.count, stride))
            lo, hi = sorted((first - self.offset, points[-1] - self.offset))
            if lo >= 0 and hi < self._count:
                # the rows made on the device and the points in Python: no copy either way
                rows = torch.arange(first - self.offset,
                                    first - self.offset + stride * steps.count, stride,
                                    device=self.states.device)
                us = self.states.index_select(0, rows)
            else:
                # a gathered level's batch: points of other ranks, fetched
                us = torch.stack([self._state(p) for p in points])
            batch = self._gathered[key] = [points, us, None]
        tensors = self.stack.rows(first, stride, steps.count)
        return self._vjp(tensors, batch[1], ws, batch[0], steps.level, steps.dt, batch)
