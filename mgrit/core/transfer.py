"""The operations between levels that a cycle makes: FAS restriction, the correction (or
injection) of C-points, and the final-sweep hook.

A cycle makes them through one `Operations` object: `Operations` makes each call directly,
`RecordedOperations` (one per recorded cycle, `mgrit.core.schedule`) makes it and records
it, so that later cycles replay the calls. The cycle itself does not know which one it
has. The tensor work runs on views of the two levels kept per level pair (`Transfer`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ..execute import Executor
from .level import Level
from .relax import phi_at, propagate_to_c_points
from .residual import Residuals
from .schedule import Schedule


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


class Transfer:
    """Views of levels l and l+1 for restriction and correction, and their temporaries:
    every call would otherwise index the same rows again (a view per index, a tensor per
    intermediate result), which costs more than the arithmetic on a coarse level's few
    points. The operations and their order are those of the expressions they replace, so
    the results are the same to the bit."""

    def __init__(self, fine: Level, coarse: Level) -> None:
        m = fine.grid.coarsening
        # the fine level's points that the coarse level's points are, and those
        self.fine_u = fine.u[fine.rows(coarse.first * m, m, coarse.count)]
        self.coarse_u, self.coarse_v = coarse.u[1:], coarse.v[1:]
        self.correction = torch.empty_like(self.coarse_u)
        # the fine level's own C-points (skipping point 0) and their coarse rows
        self.first_c, self.count = fine.c_points()
        self.j0 = self.first_c // m
        if self.count:
            rows = fine.rows(self.first_c, m, self.count)
            self.fine_u_c = fine.u[rows]
            self.fine_g_c = None if fine.g is None else fine.g[rows]
            crows = coarse.rows(self.j0, 1, self.count)
            self.coarse_v_c, self.coarse_g_c = coarse.v[crows], coarse.g[crows]
            self.residual = torch.empty_like(self.fine_u_c)
        self.phi: Tensor | None = None     # what a recorded cycle's Phi at C-points is in


class Operations:
    """Restriction, correction and the final-sweep hook of a solver's cycles, each call
    made directly. `run(fn, *args)` makes one tensor call of the cycle."""

    def __init__(self, levels: list[Level], executor: Executor, residuals: Residuals,
                 hook: Callable[[bool], None] | None) -> None:
        self.levels = levels
        self.executor = executor
        self.residuals = residuals
        self.hook = hook
        self.run: Callable[..., Any] = _call
        # Phi at level 0's C-points (first_c, count), kept while u is unchanged
        self.fine_phi: Callable[[int, int], Tensor] = residuals.phi_at_c_points
        self._transfers: dict[int, Transfer] = {}

    def recorded(self, schedule: Schedule) -> RecordedOperations:
        """The same operations, recorded in `schedule` as they are made."""
        return RecordedOperations(self, schedule)

    def transfer(self, l: int) -> Transfer:
        """The views between levels l and l+1 that restriction and correction read and write
        (made at their first use: level storage is never reallocated)."""
        views = self._transfers.get(l)
        if views is None:
            views = self._transfers[l] = Transfer(self.levels[l], self.levels[l + 1])
        return views

    def final_sweep(self, active: bool) -> None:
        """Call the `final_sweep` hook, if any: the final sweep of level 0 begins (True) or,
        after the residual, ends (False)."""
        hook = self.hook
        if hook is not None:
            hook(active)

    def restrict(self, l: int) -> None:
        """Inject level l's C-points into level l+1 and form its FAS right-hand side."""
        fine, coarse = self.levels[l], self.levels[l + 1]
        coarse.boundary.drain()
        if coarse.empty:
            return
        views = self.transfer(l)
        run = self.run
        coarse.boundary.post_v_ghost()
        run(views.coarse_v.copy_, views.fine_u)
        coarse.boundary.publish_v()
        if views.count:
            if l == 0:
                phi = self.fine_phi(views.first_c, views.count)
            else:
                phi = propagate_to_c_points(fine, self.executor, views.first_c, views.count)
            residual = views.residual
            if views.fine_g_c is None:
                run(torch.sub, phi, views.fine_u_c, out=residual)
            else:
                run(torch.sub, views.fine_g_c, views.fine_u_c, out=residual)
                run(residual.add_, phi)
            if views.j0 == coarse.first:
                coarse.boundary.wait_v_ghost()
            phi_coarse = phi_at(coarse, self.executor, coarse.v, views.j0 - 1, 1, views.count)
            run(torch.add, residual, views.coarse_v_c, out=views.coarse_g_c)
            run(views.coarse_g_c.sub_, phi_coarse)
        coarse.boundary.wait_v_ghost()
        run(coarse.u.copy_, coarse.v)

    def update_c_points(self, l: int, correct: bool) -> None:
        """Level l's C-points from level l+1: add the correction (u_c - v), or inject u_c."""
        fine, coarse = self.levels[l], self.levels[l + 1]
        if fine.empty:
            return
        fine.boundary.post_ghost(c_phase=True)
        if not coarse.empty:
            views = self.transfer(l)
            run = self.run
            if correct:
                run(torch.sub, views.coarse_u, views.coarse_v, out=views.correction)
                run(views.fine_u.add_, views.correction)
            else:
                run(views.fine_u.copy_, views.coarse_u)
        fine.boundary.changed(c_phase=True)


class RecordedOperations(Operations):
    """The operations of one recorded cycle: each call is made and recorded in the
    schedule, the cached Phi at level 0's C-points as one call that leaves it in one
    tensor whatever computed it."""

    def __init__(self, direct: Operations, schedule: Schedule) -> None:
        super().__init__(direct.levels, direct.executor, direct.residuals, direct.hook)
        self._transfers = direct._transfers     # the views are the same ones
        self.schedule = schedule
        self.run = schedule.call
        self.fine_phi = self._recorded_phi

    def _recorded_phi(self, first_c: int, count: int) -> Tensor:
        return self.schedule.call(self._phi_into, self.transfer(0))

    def _phi_into(self, views: Transfer) -> Tensor:
        """Phi at level 0's C-points in `views.phi`: the calls recorded after this one read
        that tensor, so a replay must leave the values there."""
        phi = self.residuals.phi_at_c_points(views.first_c, views.count)
        if views.phi is None:
            views.phi = phi
        elif phi is not views.phi:
            views.phi.copy_(phi)
        return views.phi

    def final_sweep(self, active: bool) -> None:
        if self.hook is not None:
            self.schedule.hook(self.hook, active)
