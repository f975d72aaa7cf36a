"""Coarse levels solved on every rank after one collective (`Config.agglomerate`).

Without it the coarsest level is one march passed from rank to rank (a hop per rank that
owns a point of it), and a coarse level with a few points per rank passes its relaxation's
intervals across ranks too: on many ranks the critical path is mostly those hops. Here
the coarse levels from level `a` down are gathered instead: the right-hand side g and the
injected values v of level a (the values its cycle starts from) go to every rank in one
sum-reduction (ceil(log2 P) hops), and every rank runs the cycle of levels a.. by itself,
on copies of those levels that hold all their points. The rank then takes its own points
of level a back and the cycle goes on as before.

Every rank solving the gathered levels (rather than one rank, which would then scatter the
result) costs a collective less on the path: a scatter would be another ceil(log2 P) hops,
and the sequential work of the gathered levels is on the path either way.

The reduction adds -0.0 from every rank that does not own a point (x + (-0.0) is x for
every x, signed zeros and NaN included) in float64, which holds every float32 and float16
value exactly: every rank gets the owners' bits, and runs the same steps on the same values
as the ranks that own them would, so the result is the same to the bit.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from ..comm import Comm, SerialComm
from ..execute import Executor
from .grid import LevelGrid, LocalLevel
from .level import Level
from .residual import Residuals
from .transfer import Operations


def first_gathered(grids: Sequence[LevelGrid], ranks: int, per_rank: int) -> int | None:
    """The first level solved on every rank: the coarsest levels (never level 0) with at
    most `per_rank` steps per rank (`num_steps <= per_rank * ranks`); None where there is
    none, where per_rank is 0 or where one rank solves everything anyway."""
    if per_rank <= 0 or ranks <= 1:
        return None
    first = None
    for grid in reversed(grids[1:]):
        if grid.num_steps > per_rank * ranks:
            break
        first = grid.level
    return first


def _real(t: Tensor) -> Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


class Gathered:
    """Levels a.. of one solver, gathered on every rank: their whole-grid copies, the
    operations between them, and the reduction buffer that brings level a's g and v."""

    def __init__(self, levels: list[Level], first: int, like: Tensor, executor: Executor,
                 residuals: Residuals, comm: Comm) -> None:
        self.first = first
        self.comm = comm
        t0, h = levels[0].t0, levels[0].h
        whole: list[Level | None] = [None] * first
        for level in levels[first:]:
            local = LocalLevel(grid=level.grid, first=0, last=level.grid.num_steps,
                               prev_rank=None, next_rank=None)
            whole.append(Level(local, like, SerialComm(), t0, h, fas=True))
        # the list is indexed by level, as the solver's is; levels above `first` are never
        # reached from here
        self.ops = Operations(whole, executor, residuals, None)  # type: ignore[arg-type]
        top, own = whole[first], levels[first]
        assert top is not None
        points = top.grid.num_steps + 1
        real = _real(like)
        # rows 0..N_a: v at every point; rows N_a+1..: g at every point
        self.buffer = torch.full((2 * points, *real.shape), -0.0, dtype=torch.float64,
                                 device=like.device)
        self.top = top
        self.own = own
        self.points = points
        if not own.empty:
            a, b = own.first, own.last
            self.own_v, self.own_g = _real(own.v[1:]), _real(own.g[1:])
            self.slot_v = self.buffer[a: b + 1]
            self.slot_g = self.buffer[points + a: points + b + 1]
            # the rank's rows of level a, ghost included, and the same points of the copy
            self.own_u = own.u
            self.whole_u = top.u[top.row(a - 1) if a > 0 else top.row(a): top.row(b) + 1]
            if a == 0:
                self.own_u = own.u[1:]
        self.top_u = _real(top.u[1:])
        self.top_g = _real(top.g[1:])

    def solve(self, cycle: Callable[[Operations, int, str, bool], None], kind: str) -> None:
        """Bring level a's g and v to every rank, run `cycle` from level a on the copies,
        and take the rank's own points of level a back."""
        buffer = self.buffer
        buffer.fill_(-0.0)
        if not self.own.empty:
            self.slot_v.copy_(self.own_v)
            self.slot_g.copy_(self.own_g)
        self.comm.allreduce_sum_(buffer)
        self.top_u.copy_(buffer[:self.points])
        self.top_g.copy_(buffer[self.points:])
        cycle(self.ops, self.first, kind, True)
        if not self.own.empty:
            self.own_u.copy_(self.whole_u)
