"""A compiled phase of adjoint steps (`AdjointPropagator.step_program`) and the kept op
outputs it reads. What it reads of them, and how the parameter cotangents it records are
laid out, the step strategy says (`phase_values`, `phase_cotangents`): this module only
keeps the phase valid while the forward pass's kept outputs change under it."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Callable

from torch import Tensor

from ...core.propagator import Step
from ...kernels.contract import Kept, Tensors

if TYPE_CHECKING:
    from .adjoint import AdjointPropagator


class AdjointPhase:
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
        self.cotangents: Tensors | None = None
        descending = all(a > b for a, b in zip(self.points, self.points[1:]))
        self.layers = self.points[::-1] if descending else self.points
        self._compile()

    def _kept_values(self) -> list[Tensor]:
        """What each step reads of its kept outputs (computed now where none are kept),
        noting where it was read from (`sources`, what every run checks)."""
        prop = self.prop
        ys, self.sources = [], []
        for p in self.points:
            kept = prop._single_kept(p, prop.stack.views(p))
            y, source = prop.kernels.phase_values(kept)
            ys.append(y)
            self.sources.append((source, kept[1]))
        return ys

    def _compile(self) -> None:
        prop = self.prop
        ys = self._kept_values()
        tensors = [prop.stack.views(p) for p in self.points]
        record = None
        if self.record:
            count = len(self.points)
            self.cotangents = prop.kernels.phase_cotangents(tensors[0], count)
            # step i writes row i, or row count-1-i where the rows go in layer order
            order = range(count) if self.layers is self.points else range(count - 1, -1, -1)
            record = ([prop.states[p - prop.offset] for p in self.points], self.cotangents,
                      order)
        self.program = prop.kernels.vjp_program(tensors, ys, self.rows, self.steps[0].dt,
                                                record)

    def _refresh(self) -> None:
        """New kept outputs (torch's strategy, which computes large forward batches, keeps
        them in new tensors every pass): their addresses go into the program's table, or
        the phase is compiled again where one does not suit it."""
        ys = self._kept_values()
        if self.program is None or not self.program.set_operand(2, ys):
            self._compile()

    def _check(self, outputs: dict[int, Kept]) -> None:
        """Refresh where a step's kept values are no longer read from their source; note
        the entries."""
        computed = self.prop._computed
        kernels = self.prop.kernels
        for p, (source, k) in zip(self.points, self.sources):
            now = outputs.get(p) or computed.get(p)     # `AdjointPropagator._kept`, inlined
            if now is None or now[1] != k or kernels.phase_values(now)[1] is not source:
                self._refresh()
                break
        entries = [outputs.get(p) for p in self.points]
        # outputs the backward solve computed (`_computed`, new at every solve) are not in
        # the forward's entries: such a phase checks step by step at every run
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
