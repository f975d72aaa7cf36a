"""Coarse levels solved on every rank after one collective (`Config.agglomerate`).

Without it the coarsest level is one march passed from rank to rank (a hop per rank that
owns a point of it), and a coarse level with a few points per rank passes its relaxation's
intervals across ranks too: on many ranks the critical path is mostly those hops. Here
the coarse levels from level `a` down are gathered instead: the right-hand side g and the
injected values v of level a (the values its cycle starts from, at its C-points) go to
every rank in one
sum-reduction (ceil(log2 P) hops), and every rank runs the cycle of levels a.. by itself,
on copies of those levels that hold all their points. The rank then takes its own points
of level a back and the cycle goes on as before.

A nested start (`Gathered.nested`) needs no reduction at all: it reads nothing but u0,
which every rank holds, so every rank marches the coarsest copy from it and injects level
by level on the copies.

A propagator whose steps read data only their own rank holds (`local_steps`) takes part
where it can fetch that data (`gather_steps(grids, comm)`, called once with the gathered
levels' grids): a layer-parallel network's propagators bring the layers, and the adjoint's
the forward states, of those steps to every rank before each solve
(`mgrit.nn.engine.fetch`).

Every rank solving the gathered levels (rather than one rank, which would then scatter the
result) costs a collective less on the path: a scatter would be another ceil(log2 P) hops,
and the sequential work of the gathered levels is on the path either way.

The reduction adds -0.0 from every rank that does not own a point (x + (-0.0) is x for
every x, signed zeros and NaN included), in the states' own precision (float16 and
bfloat16 in float64, which holds each of their values exactly): every rank gets the
owners' bits, and runs the same steps on the same values
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
from .relax import sweep
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


# dtypes a sum-reduction carries as they are; others (float16, bfloat16, which MPI may not
# sum) go as float64, which holds each of their values exactly
_CARRIED = (torch.float32, torch.float64)


def carried_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which a sum-reduction that adds -0.0 carries values of `dtype` exactly."""
    return dtype if dtype in _CARRIED else torch.float64


class Gathered:
    """Levels a.. of one solver, gathered on every rank: their whole-grid copies, the
    operations between them, and the reduction buffer that brings level a's values.

    What the cycle of level a reads before it writes: g at the points 1..N_a, and u (which
    starts as v) at its C-points only, since its first F-relaxation (or, on the coarsest
    level, its march) sets every F-point from them before any is read. The buffer holds
    g_1..g_N in rows 1..N, v_0 in row 0, and v at the C-points m, 2m, ... in the rows after
    N, so it carries N + 1 + N/m states rather than 2 (N + 1)."""

    def __init__(self, levels: list[Level], first: int, like: Tensor, executor: Executor,
                 residuals: Residuals, comm: Comm) -> None:
        self.first = first
        self.comm = comm
        self.executor = executor
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
        self.top, self.own = top, own
        n = top.grid.num_steps
        m = top.grid.coarsening or (n + 1)      # the coarsest level: no C-point but 0
        real = _real(like)
        dtype = carried_dtype(real.dtype)
        self.buffer = torch.full((n + 1 + n // m, *real.shape), -0.0, dtype=dtype,
                                 device=like.device)
        # (the rank's rows, their slot in the buffer) to pack and (buffer rows, the copy's
        # rows) to unpack
        self.pack: list[tuple[Tensor, Tensor]] = []
        self.unpack = [(self.buffer[1:n + 1], _real(top.g[top.row(1):])),
                       (self.buffer[0], _real(top.u[top.row(0)]))]
        if n // m:
            self.unpack.append((self.buffer[n + 1:], _real(top.u[top.rows(m, m, n // m)])))
        if not own.empty:
            a, b = own.first, own.last
            if b >= max(a, 1):
                lo = max(a, 1)
                self.pack.append((_real(own.g[own.row(lo): own.row(b) + 1]),
                                  self.buffer[lo: b + 1]))
            if a == 0:
                self.pack.append((_real(own.v[own.row(0)]), self.buffer[0]))
            first_c = max(-(-a // m) * m, m)
            if first_c <= b:
                count = (b - first_c) // m + 1
                slot = n + first_c // m
                self.pack.append((_real(own.v[own.rows(first_c, m, count)]),
                                  self.buffer[slot: slot + count]))
            # the rank's rows of level a, ghost included, and the same points of the copy
            self.own_u = own.u if a > 0 else own.u[1:]
            self.whole_u = top.u[top.row(max(a - 1, 0)): top.row(b) + 1]

    def solve(self, cycle: Callable[[Operations, int, str, bool], None], kind: str) -> None:
        """Bring level a's g and v to every rank, run `cycle` from level a on the copies,
        and take the rank's own points of level a back."""
        buffer = self.buffer
        buffer.fill_(-0.0)
        for rows, slot in self.pack:
            slot.copy_(rows)
        self.comm.allreduce_sum_(buffer)
        for rows, dest in self.unpack:
            dest.copy_(rows)
        cycle(self.ops, self.first, kind, True)
        if not self.own.empty:
            self.own_u.copy_(self.whole_u)

    def nested(self, u0: Tensor, cycle: Callable[[Operations, int, str, bool], None]) -> None:
        """The nested start of levels a.. on the copies, as the solver's own is made on its
        levels: the coarsest level marched from u0, then each level's C-points injected
        from the one below and a V-cycle run on it; then the rank's own points of level a
        taken back. No reduction: the start reads nothing but u0, which every rank holds."""
        whole = self.ops.levels
        for level in whole[self.first:]:
            level.u.zero_()
            level.g.zero_()
            level.u[level.row(0)].copy_(u0)
        sweep(whole[-1], self.executor)
        for l in range(len(whole) - 2, self.first - 1, -1):
            self.ops.update_c_points(l, correct=False)
            cycle(self.ops, l, "V", True)
        if not self.own.empty:
            self.own_u.copy_(self.whole_u)
