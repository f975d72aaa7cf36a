"""F- and C-relaxation over one level, and the sequential march they share.

On level l the point j is updated as u_j = g_j + Phi(u_{j-1}) (g is zero on
level 0). F-relaxation advances every coarse interval from its C-point
through its F-points: the m-1 sub-steps each go over all of the rank's
intervals in one executor call. An interval whose C-point lies on an earlier
rank (the rank's leading F-points) is marched step by step once the previous
rank's last point has arrived; the rank's own last point is sent on before that
wait, so a run of such ranks does not become a chain.

The parts of a sweep between its messages (the batched sub-steps, a march) go through
`_sweep`, which an executor with CUDA graphs (Config.cuda_graphs) captures and replays;
where the propagator compiles phases (`CompiledPropagator`), such a part is instead one
compiled call of all its steps (`Phases.program`), built once per level and phase.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import Tensor

from ..execute import Executor
from .level import Level
from .phases import PhaseSteps
from .propagator import Capabilities


def _sweep(executor: Executor, level: Level, name: str, work: Callable[[], None]) -> None:
    """Run `work`, tensor work of one sweep of `level`, through the executor's CUDA graphs
    where it has them."""
    graphs = executor.graphs
    if graphs is None:
        work()
    else:
        graphs.run((level.index, name), level.u, work)


def march(level: Level, caps: Capabilities, j_from: int, j_to: int) -> None:
    """Sequentially set u_j = g_j + Phi(u_{j-1}) for j = j_from..j_to."""
    u, g = level.row_views()
    into = caps.step_into
    for j in range(j_from, j_to + 1):
        row = j - level.offset
        if into is not None:
            into(u[row - 1], level.step(j - 1), u[row], None if g is None else g[row])
            continue
        out = caps.step(u[row - 1], level.step(j - 1))
        u[row].copy_(out if g is None else g[row] + out)


def _updates(level: Level, points: Iterable[int]) -> tuple[list, list]:
    """The steps u_j = g_j + Phi(u_{j-1}) of a compiled phase for the points j in the order
    given, and their rows (u_{j-1}, u_j, g_j or None)."""
    u, g = level.row_views()
    steps, rows = [], []
    for j in points:
        row = j - level.offset
        steps.append(level.step(j - 1))
        rows.append((u[row - 1], u[row], None if g is None else g[row]))
    return steps, rows


def _march_steps(level: Level, j_from: int, j_to: int) -> PhaseSteps:
    """The steps of `march(level, ..., j_from, j_to)`, for a compiled phase."""
    return (*_updates(level, range(j_from, j_to + 1)), 1)


def _run_march(level: Level, executor: Executor, name: str, j_from: int, j_to: int) -> None:
    """`march` as one compiled phase where the propagator has one, else step by step."""
    program = level.phases.program(name, executor, 1,
                                   lambda: _march_steps(level, j_from, j_to))
    if program is not None:
        program()
    else:
        _sweep(executor, level, name, lambda: march(level, executor.caps, j_from, j_to))


def _interval_steps(level: Level, first_c: int) -> PhaseSteps:
    """The steps of F-relaxation over the intervals that begin at the rank's C-points from
    first_c, interval by interval (each one's steps in order)."""
    m = level.grid.coarsening
    starts = range(first_c, level.last + 1, m)
    points = [j for c in starts for j in range(c + 1, min(c + m - 1, level.last) + 1)]
    return (*_updates(level, points), len(starts))


def phi_at(level: Level, executor: Executor, src: Tensor, first: int, stride: int,
           count: int) -> Tensor:
    """Phi(point j of src) for j = first, first + stride, ... (count of them), src holding
    the level's points as its rows (u or v): one batched call, or a compiled phase that
    writes into a buffer of the level (valid until the same phase runs again)."""
    name = ("phi", src is level.v, first, stride, count)

    def build() -> PhaseSteps:
        buf = level.phases.buffer(name, count)
        points = range(first, first + stride * count, stride)
        return ([level.step(j) for j in points],
                [(src[level.row(j)], buf[i], None) for i, j in enumerate(points)], count)

    program = level.phases.program(name, executor, count, build)
    if program is not None:
        program()
        return level.phases.buffer(name, count)
    return executor.advance(src[level.rows(first, stride, count)],
                            level.batch(first, stride, count))


def f_relax(level: Level, executor: Executor) -> None:
    """Propagate every coarse interval from its C-point through its F-points."""
    if level.empty:
        return
    m = level.grid.coarsening
    u, g = level.u, level.g
    level.boundary.post_ghost(c_phase=False)
    first_c, _ = level.c_points(skip_zero=False)

    def intervals() -> None:
        for k in range(1, m):
            if level.last - k < first_c:
                break
            count = (level.last - k - first_c) // m + 1
            src = u[level.rows(first_c + k - 1, m, count)]
            dst = level.rows(first_c + k, m, count)
            executor.advance_into(src, level.batch(first_c + k - 1, m, count), u[dst],
                                  None if g is None else g[dst])

    if first_c <= level.last:
        program = level.phases.program("f", executor, (level.last - first_c) // m + 1,
                                lambda: _interval_steps(level, first_c))
        if program is not None:
            program()
        else:
            _sweep(executor, level, "f", intervals)
    leading = level.first < first_c        # F-points of an interval begun on an earlier rank
    last = min(first_c - 1, level.last)
    if leading and first_c <= level.last:
        # the last point closes one of this rank's own intervals and is final already: pass
        # it on before waiting for the ghost, or the ranks would wait for each other in turn
        level.boundary.changed(c_phase=False)
        level.boundary.wait_ghost()
        _run_march(level, executor, "f-lead", level.first, last)
        level.boundary.touched()
        return
    if leading:
        level.boundary.wait_ghost()
        _run_march(level, executor, "f-lead", level.first, last)
    level.boundary.changed(c_phase=False)


def propagate_to_c_points(level: Level, executor: Executor, first_c: int, count: int
                          ) -> Tensor:
    """Phi(u_{c-1}) for the rank's C-points c = first_c, first_c + m, ... (count of them)."""
    if first_c == level.first:
        level.boundary.wait_ghost()
    return phi_at(level, executor, level.u, first_c - 1, level.grid.coarsening, count)


def c_relax(level: Level, executor: Executor, weight: float) -> None:
    """u_c = w*(g_c + Phi(u_{c-1})) + (1-w)*u_c at the rank's C-points (not point 0)."""
    if level.empty:
        return
    level.boundary.post_ghost(c_phase=True)
    first_c, count = level.c_points()
    program = (level.phases.program("c", executor, count,
                                    lambda: _c_steps(level, first_c, count))
               if count and weight == 1.0 else None)
    if program is not None:
        if first_c == level.first:
            level.boundary.wait_ghost()
        program()
    elif count:
        level.phases.step_by_step()
        new = propagate_to_c_points(level, executor, first_c, count)
        rows = level.rows(first_c, level.grid.coarsening, count)
        if weight == 1.0 and level.g is not None:
            torch.add(level.g[rows], new, out=level.u[rows])
        elif weight == 1.0:
            level.u[rows] = new
        else:
            if level.g is not None:
                new = level.g[rows] + new
            level.u[rows] = weight * new + (1.0 - weight) * level.u[rows]
    level.boundary.changed(c_phase=True)


def _c_steps(level: Level, first_c: int, count: int) -> PhaseSteps:
    """The steps of C-relaxation (weight 1) at the rank's C-points from first_c."""
    m = level.grid.coarsening
    return (*_updates(level, range(first_c, first_c + m * count, m)), count)


def sweep(level: Level, executor: Executor) -> None:
    """Solve the coarsest level: one march over all points, rank after rank."""
    if level.empty:
        return
    level.boundary.post_ghost(c_phase=False)
    if level.first > 0:
        level.boundary.wait_ghost()
    _run_march(level, executor, "sweep", max(level.first, 1), level.last)
    level.boundary.changed(c_phase=False)
