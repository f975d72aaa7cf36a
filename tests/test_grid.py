"""Index maths of the hierarchy and the partition, checked for many fake ranks in one process."""

import pytest

from mgrit.core.grid import (alignment, build_hierarchy, level0_blocks, local_levels, owned_range,
                        split_points)


def test_hierarchy_sizes_and_strides():
    grids = build_hierarchy(16384, [4, 4, 4, 4], levels=5, min_coarse=2)
    assert [g.num_steps for g in grids] == [16384, 4096, 1024, 256, 64]
    assert [g.stride for g in grids] == [1, 4, 16, 64, 256]
    assert [g.coarsening for g in grids] == [4, 4, 4, 4, None]


def test_hierarchy_stops_at_min_coarse_and_uses_per_level_factors():
    grids = build_hierarchy(100, [2, 5, 4], levels=6, min_coarse=3)
    # 100 -> 50 -> 10 -> 2 (< 3, so stop at 10)
    assert [g.num_steps for g in grids] == [100, 50, 10]
    assert grids[-1].is_coarsest and grids[2].stride == 10


def test_hierarchy_with_uneven_division_keeps_floor():
    grids = build_hierarchy(1001, [4, 4], levels=3, min_coarse=1)
    assert [g.num_steps for g in grids] == [1001, 250, 62]


@pytest.mark.parametrize("points,size", [(17, 1), (17, 4), (5, 8), (1025, 64), (64, 64)])
def test_split_points_covers_every_point_once(points, size):
    blocks = split_points(points, size)
    owned = [p for first, last in blocks for p in range(first, last + 1)]
    assert owned == list(range(points))
    counts = [last - first + 1 for first, last in blocks]
    assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize("points,size,align", [(16385, 2, 256), (1025, 3, 16), (4097, 7, 64)])
def test_aligned_split_starts_blocks_at_multiples(points, size, align):
    blocks = split_points(points, size, align)
    assert [p for a, b in blocks for p in range(a, b + 1)] == list(range(points))
    assert all(a % align == 0 for a, _ in blocks)
    counts = [b - a + 1 for a, b in blocks]
    assert max(counts) - min(counts) <= align


def test_alignment_picks_the_coarsest_stride_that_keeps_balance():
    grids = build_hierarchy(16384, [4] * 4, levels=5, min_coarse=2)
    assert alignment(grids, 2) == 256          # 16385 / 64 = 256
    assert alignment(grids, 8) == 64           # 16385 / 256 = 64
    assert alignment(grids, 64) == 4
    assert alignment(grids, 1024) == 1
    blocks = level0_blocks(grids, 2)
    assert blocks == [(0, 8191), (8192, 16384)]
    # every rank's first point is then a C-point on every relaxation level
    for rank in range(2):
        for loc in local_levels(grids, 2, rank)[:-1]:
            assert loc.grid.is_c_point(loc.first)


@pytest.mark.parametrize("num_steps,coarsening,levels", [
    (16, [2, 2, 2], 4), (100, [4, 4], 3), (1023, [2, 4, 2, 2], 5), (37, [3, 2], 3), (7, [2], 2),
])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 64])
def test_partition_of_every_level(num_steps, coarsening, levels, size):
    grids = build_hierarchy(num_steps, coarsening, levels, min_coarse=1)
    per_rank = [local_levels(grids, size, rank) for rank in range(size)]
    blocks = level0_blocks(grids, size)
    for l, grid in enumerate(grids):
        owner = {}
        for rank in range(size):
            loc = per_rank[rank][l]
            for j in range(loc.first, loc.last + 1):
                assert j not in owner, f"point {j} of level {l} owned twice"
                owner[j] = rank
                # a coarse point lives where its fine point lives
                a, b = blocks[rank]
                assert a <= j * grid.stride <= b
        assert sorted(owner) == list(range(grid.num_steps + 1)), f"level {l} not covered"
        for rank in range(size):
            loc = per_rank[rank][l]
            if loc.empty:
                assert loc.prev_rank is None and loc.next_rank is None
                continue
            assert loc.prev_rank == (owner[loc.first - 1] if loc.first > 0 else None)
            assert loc.next_rank == (owner[loc.last + 1] if loc.last < grid.num_steps else None)


def test_owned_range_can_be_empty_on_coarse_levels():
    grid = build_hierarchy(64, [8, 8], levels=3, min_coarse=1)[2]  # points 0 and 1 (fine 0, 64)
    assert owned_range(grid, (10, 20)) == (1, 0)
    assert owned_range(grid, (60, 64)) == (1, 1)


@pytest.mark.parametrize("num_steps,size", [(32, 2), (32, 3), (1024, 64), (7, 4), (100, 7)])
def test_level0_blocks_share_the_steps_evenly(num_steps, size):
    """Point 0 is never computed: every rank's number of computed points (steps) is within
    one of every other's, the blocks covering 0..num_steps once."""
    grids = build_hierarchy(num_steps, [num_steps + 1], levels=1, min_coarse=1)
    blocks = level0_blocks(grids, size)
    assert [p for a, b in blocks for p in range(a, b + 1)] == list(range(num_steps + 1))
    steps = [len([p for p in range(a, b + 1) if p > 0]) for a, b in blocks]
    assert max(steps) - min(steps) <= 1
    assert sum(steps) == num_steps
