"""Index maths of the time-grid hierarchy and its partition over ranks.

Pure functions of integers: no tensors, no MPI. Level 0 has the points
0..N (N steps); level l+1 keeps every m_l-th point of level l. A rank owns a
contiguous block of level-0 points, and on every level the points whose
level-0 position falls in that block, so a coarse point always lives on the
rank that owns its fine interval's first point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class LevelGrid:
    """One level of the hierarchy.

    `num_steps` steps join points 0..num_steps; one step on this level spans
    `stride` level-0 steps; `coarsening` is the factor to the next coarser
    level, or None on the coarsest level.
    """

    level: int
    num_steps: int
    stride: int
    coarsening: int | None

    @property
    def is_coarsest(self) -> bool:
        return self.coarsening is None

    def is_c_point(self, j: int) -> bool:
        """C-points are kept on the next level; the coarsest level has only point 0."""
        if self.coarsening is None:
            return j == 0
        return j % self.coarsening == 0


def build_hierarchy(num_steps: int, coarsening: Sequence[int], levels: int,
                    min_coarse: int) -> list[LevelGrid]:
    """Levels of the grid: coarsen by coarsening[l] while fewer than `levels`
    exist and the next level keeps at least `min_coarse` steps."""
    sizes = [num_steps]
    factors: list[int] = []
    while len(sizes) < levels:
        m = coarsening[len(sizes) - 1]
        coarse = sizes[-1] // m
        if coarse < max(min_coarse, 1):
            break
        factors.append(m)
        sizes.append(coarse)
    grids = []
    stride = 1
    for level, n in enumerate(sizes):
        m = factors[level] if level < len(factors) else None
        grids.append(LevelGrid(level=level, num_steps=n, stride=stride, coarsening=m))
        if m is not None:
            stride *= m
    return grids


def split_points(num_points: int, size: int, align: int = 1) -> list[tuple[int, int]]:
    """Contiguous blocks (first, last) of `num_points` points over `size` ranks.

    Block boundaries sit at the multiple of `align` nearest to an even split. A rank
    with no point gets (first, first - 1).
    """
    return _split(num_points, size, align, skip=0)


def split_steps(num_steps: int, size: int, align: int = 1) -> list[tuple[int, int]]:
    """Blocks (first, last) of the points 0..num_steps that share the steps evenly.

    Point 0 is given, never computed: rank 0 holds it besides its share of the points
    1..num_steps, each of which costs one step. Boundaries sit at the multiple of `align`
    nearest to that split.
    """
    return _split(num_steps + 1, size, align, skip=1)


def _split(num_points: int, size: int, align: int, skip: int) -> list[tuple[int, int]]:
    """Blocks whose shares of the points skip..num_points-1 are even (to `align`)."""
    starts = [0]
    for rank in range(1, size):
        ideal = skip + rank * (num_points - skip) / size
        start = min(max(align * math.floor(ideal / align + 0.5), starts[-1]), num_points)
        starts.append(start)
    starts.append(num_points)
    return [(starts[r], starts[r + 1] - 1) for r in range(size)]


def alignment(grids: Sequence[LevelGrid], num_ranks: int) -> int:
    """The level-0 multiple that rank blocks start at.

    Starting every block at a coarsest-level point makes the first point of every rank a
    C-point on all relaxation levels, so no coarse interval straddles two ranks and no
    rank marches an interval's F-points one by one after its neighbour. The largest level
    stride is taken that still leaves every block within 1/32 of an even split.
    """
    target = (grids[0].num_steps + 1) / (32 * num_ranks)
    return max([g.stride for g in grids if g.stride <= target], default=1)


def level0_blocks(grids: Sequence[LevelGrid], num_ranks: int) -> list[tuple[int, int]]:
    """The level-0 points (first, last) of every rank."""
    return split_steps(grids[0].num_steps, num_ranks, alignment(grids, num_ranks))


def owned_range(grid: LevelGrid, block: tuple[int, int]) -> tuple[int, int]:
    """Points (first, last) of `grid` owned by the rank holding level-0 `block`.

    Empty when last < first.
    """
    a, b = block
    first = -(-a // grid.stride)
    last = min(b // grid.stride, grid.num_steps)
    return first, last


@dataclass(frozen=True)
class LocalLevel:
    """What one rank owns on one level and who its neighbours there are.

    `prev_rank` owns point first-1 and `next_rank` owns point last+1 (None at
    the ends of the grid or when the rank owns nothing on this level).
    """

    grid: LevelGrid
    first: int
    last: int
    prev_rank: int | None
    next_rank: int | None

    @property
    def count(self) -> int:
        return max(self.last - self.first + 1, 0)

    @property
    def empty(self) -> bool:
        return self.last < self.first


def check_blocks(blocks: Sequence[tuple[int, int]], num_points: int) -> None:
    """Blocks must cover 0..num_points-1 contiguously, in rank order (empty ones allowed)."""
    expected = 0
    for first, last in blocks:
        if last >= first:
            if first != expected:
                raise ValueError(f"rank blocks {list(blocks)} do not cover 0..{num_points - 1} "
                                 "contiguously in rank order")
            expected = last + 1
    if expected != num_points:
        raise ValueError(f"rank blocks {list(blocks)} do not cover 0..{num_points - 1}")


def local_levels(grids: Sequence[LevelGrid], num_ranks: int, rank: int,
                 blocks: Sequence[tuple[int, int]] | None = None) -> list[LocalLevel]:
    """The rank's part of every level, with its neighbours on that level.

    `blocks` gives each rank's level-0 points; by default `level0_blocks`.
    """
    if blocks is None:
        blocks = level0_blocks(grids, num_ranks)
    result = []
    for grid in grids:
        ranges = [owned_range(grid, block) for block in blocks]
        first, last = ranges[rank]
        prev_rank = next_rank = None
        if last >= first:
            if first > 0:
                prev_rank = max(r for r in range(rank) if ranges[r][1] >= ranges[r][0])
            if last < grid.num_steps:
                next_rank = min(r for r in range(rank + 1, num_ranks)
                                if ranges[r][1] >= ranges[r][0])
        result.append(LocalLevel(grid=grid, first=first, last=last,
                                 prev_rank=prev_rank, next_rank=next_rank))
    return result


# Layers of a residual network: layer n is the step from point n to n+1. ------------------

def layer_ranges(blocks: Sequence[tuple[int, int]], num_steps: int) -> list[tuple[int, int]]:
    """Layers (first, last) each rank owns: layer n lives with point n+1, whose update on
    the fine level uses it, so fine forward steps never need another rank's layer."""
    ranges = []
    for first, last in blocks:
        lo, hi = max(first - 1, 0), min(last - 1, num_steps - 1)
        ranges.append((lo, hi) if last >= first and hi >= lo else (lo, lo - 1))
    return ranges


def adjoint_blocks(blocks: Sequence[tuple[int, int]], num_steps: int) -> list[tuple[int, int]]:
    """Level-0 blocks of the adjoint solve, in reversed rank numbering.

    The adjoint runs on the reversed grid (reversed point k is forward point N - k) and
    its step from reversed point k to k+1 is the VJP of layer N-1-k. Giving each rank the
    forward points of its own layers (and point N to the owner of layer N-1) makes every
    adjoint step, fine or coarse, use a layer and a forward state the rank already holds.
    Rank r of the forward numbering is rank size-1-r of the adjoint one.
    """
    forward = []
    for (first, last), (lo, hi) in zip(blocks, layer_ranges(blocks, num_steps)):
        if hi < lo:
            forward.append(None)
        else:
            forward.append((lo, num_steps if last == num_steps else hi))
    reversed_blocks = []
    for span in reversed(forward):
        if span is None:
            reversed_blocks.append((0, -1))
        else:
            reversed_blocks.append((num_steps - span[1], num_steps - span[0]))
    # empty blocks take the position of their neighbours so the list stays ordered
    fixed, nxt = [], 0
    for first, last in reversed_blocks:
        fixed.append((first, last) if last >= first else (nxt, nxt - 1))
        if last >= first:
            nxt = last + 1
    return fixed


def coarse_layer_needs(grids: Sequence[LevelGrid],
                       blocks: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(rank, layer, owner) for every layer a rank's coarse forward steps use but another
    rank owns: a coarse step j on level l ends at point j+1 (where it is computed) and uses
    layer j*M_l, which may lie before the rank's block. At most one per level and rank."""
    num_steps = grids[0].num_steps
    ranges = layer_ranges(blocks, num_steps)

    def owner(layer: int) -> int:
        return next(r for r, (lo, hi) in enumerate(ranges) if lo <= layer <= hi)

    needs = set()
    for rank, block in enumerate(blocks):
        lo, hi = ranges[rank]
        for grid in grids[1:]:
            first, last = owned_range(grid, block)
            first = max(first, 1)
            if last < first:
                continue
            layer = (first - 1) * grid.stride
            if not lo <= layer <= hi:
                needs.add((rank, layer, owner(layer)))
    return sorted(needs)
