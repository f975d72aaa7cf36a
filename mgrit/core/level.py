"""One level's state storage on one rank and its row maths.

Rows of `u` (and `v`, `g`) hold the rank's points first..last at rows 1..count;
row 0 is the ghost: a copy of point first-1, owned by the previous rank. The messages that
keep the ghost current are the level's `boundary` (`mgrit.core.boundary`); the compiled
calls of its relaxation phases are its `phases` (`mgrit.core.phases`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..comm import Comm
from .boundary import Boundary
from .grid import LocalLevel
from .phases import Phases
from .propagator import Step, StepBatch, make_step

if TYPE_CHECKING:
    from .schedule import Schedule


class Level:
    """Storage, row maths and steps of one level on one rank."""

    def __init__(self, local: LocalLevel, like: Tensor, comm: Comm, t0: float, h: float,
                 fas: bool) -> None:
        self.local = local
        self.grid = local.grid
        self.index = local.grid.level
        self.first, self.last = local.first, local.last
        self.count = local.count
        self.empty = self.count == 0     # asked by every phase: an attribute, not a property
        self.offset = self.first - 1
        self.t0, self.h = t0, h
        self.dt = h * self.grid.stride
        # a rank with no point on this level stores nothing (not even the ghost row)
        shape = (self.count + 1 if self.count else 0, *like.shape)
        self.u = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.v = torch.zeros_like(self.u) if fas else None
        self.g = torch.zeros_like(self.u) if fas else None
        self.version = 0   # bumped by every change of u, so results computed from it can be reused
        self._rows: tuple[list[Tensor], list[Tensor] | None] | None = None
        # the row that holds point 0, the initial value: the rank's own first row, or the
        # ghost where the rank's first point is point 1; None where it holds neither
        self.initial_row = (self.u[1] if self.count and self.first == 0 else
                            self.u[0] if self.count and self.first == 1 else None)
        self._steps: dict[int, Step] = {}
        self.boundary = Boundary(self, comm)
        self.phases = Phases(self.index, like)

    @property
    def recorder(self) -> Schedule | None:
        """The solver's record of the cycle being recorded (`mgrit.core.schedule`), else
        None: the level's messages and compiled phases record their calls in it."""
        return self.boundary.recorder

    @recorder.setter
    def recorder(self, schedule: Schedule | None) -> None:
        self.boundary.recorder = self.phases.recorder = schedule

    def row_views(self) -> tuple[list[Tensor], list[Tensor] | None]:
        """One view per row of u and of g (None on level 0), made at the first march of
        this level and kept (u and g are never reallocated): a march takes one step at a
        time and would otherwise make two views per step. Not made up front: a level that
        is never marched (the fine levels of a serial solve) would pay for a view per point
        at every Solver construction."""
        if self._rows is None:
            self._rows = (list(self.u), None if self.g is None else list(self.g))
        return self._rows

    def row(self, j: int) -> int:
        return j - self.offset

    def rows(self, first_j: int, stride: int, count: int) -> slice:
        """Rows of the points first_j, first_j + stride, ... (count of them)."""
        start = first_j - self.offset
        return slice(start, start + stride * (count - 1) + 1, stride)

    def c_points(self, skip_zero: bool = True) -> tuple[int, int]:
        """(first C-point, number of C-points) in the rank's range; point 0 left out
        when `skip_zero`, for operations that never change the initial value."""
        m = self.grid.coarsening or (self.grid.num_steps + 1)
        first_c = -(-self.first // m) * m
        if skip_zero and first_c == 0:
            first_c = m
        count = (self.last - first_c) // m + 1 if self.last >= first_c else 0
        return first_c, count

    def step(self, index: int) -> Step:
        """The step from point `index` to `index + 1` on this level."""
        step = self._steps.get(index)
        if step is None:
            step = self._steps[index] = make_step(self.index, index, self.grid.stride, self.t0,
                                                  self.h)
        return step

    def batch(self, start: int, stride: int, count: int) -> StepBatch:
        return StepBatch(self.index, start, stride, count, self.grid.stride, self.t0, self.h)
