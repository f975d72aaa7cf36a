"""The residual of a solve: Phi at level 0's C-points (kept while u is unchanged), this
rank's part of the squared norm, the reductions over the ranks, and the divergence check.

The residual after a cycle is the 2-norm over the fine C-points j >= 1 of
Phi(u_{j-1}) - u_j (docs/design.md, section 2). A solve reduces it over the ranks after
every cycle, or, where it runs a fixed number of cycles, reduces every cycle's part at
once at the end, together with the state at t1 (`Residuals.norms_and_final`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from ..comm import Comm
from ..execute import Executor
from .level import Level
from .relax import propagate_to_c_points


class DivergenceError(RuntimeError):
    """The residual became NaN/Inf or grew past Config.divergence_factor times its first value.

    `residuals` holds the history up to and including the offending cycle.
    """

    def __init__(self, message: str, residuals: list[float]) -> None:
        super().__init__(message)
        self.residuals = residuals


class Residuals:
    """Residual norms of one solver's level 0 on this rank, and their reductions."""

    def __init__(self, fine: Level, executor: Executor, comm: Comm, final_owner: int,
                 final_point: int) -> None:
        self.fine = fine
        self.executor = executor
        self.comm = comm
        self.final_owner = final_owner        # the rank that holds the state at t1
        self._final_point = final_point
        self._phi_cache: tuple[int, Tensor] | None = None
        # the fine C-points' rows and a buffer for their residual (`local`)
        self._views: tuple[Tensor, Tensor] | None = None
        # the static buffers of a captured solve's device history (`mgrit.core.device_history`)
        self.device_norms: Any = None
        # float64 buffers of `norms_and_final`'s reduction, by size
        self._sums: dict[int, Tensor] = {}

    def forget(self) -> None:
        """A new solve begins: Phi of an earlier solve's states is stale."""
        self._phi_cache = None

    def phi_at_c_points(self, first_c: int, count: int) -> Tensor:
        """Phi(u_{c-1}) at the rank's C-points of level 0, reused while u is unchanged: with
        F-relaxation the residual after a cycle and the next restriction need the same values."""
        fine = self.fine
        cached = self._phi_cache
        if cached is not None and cached[0] == fine.version:
            return cached[1]
        phi = propagate_to_c_points(fine, self.executor, first_c, count)
        self._phi_cache = (fine.version, phi)
        return phi

    def local(self) -> float:
        """This rank's part of the squared residual norm."""
        difference = self.difference()
        if difference is None:
            return 0.0
        return float(torch.linalg.vector_norm(difference)) ** 2

    def local_into(self, out: Tensor) -> None:
        """`local` written into the float64 scalar `out`, on the states' device and with no
        host read: float(norm) ** 2 in double, the same value to the bit."""
        difference = self.difference()
        if difference is None:
            out.zero_()
        else:
            torch.square(torch.linalg.vector_norm(difference).to(torch.float64), out=out)

    def difference(self) -> Tensor | None:
        """Phi(u_{c-1}) - u_c at the rank's C-points of level 0, in a buffer kept for it;
        None where the rank has none (or level 0 is the only level)."""
        fine = self.fine
        if fine.empty or fine.grid.is_coarsest:
            return None
        first_c, count = fine.c_points()
        if not count:
            return None
        phi = self.phi_at_c_points(first_c, count)
        views = self._views
        if views is None:
            # level storage is never reallocated: the C-points' rows and the difference's
            # buffer are made once
            u_c = fine.u[fine.rows(first_c, fine.grid.coarsening, count)]
            views = self._views = (u_c, torch.empty_like(u_c))
        torch.sub(phi, views[0], out=views[1])
        return views[1]

    def norm(self, local: float) -> float:
        """The residual norm over all ranks from this rank's part."""
        return math.sqrt(self.comm.allreduce_sum(local))

    def norms(self, local: list[float]) -> list[float]:
        """Residual norms from every rank's parts, all in one reduction."""
        if self.comm.size == 1:
            return [math.sqrt(x) for x in local]
        buf = torch.tensor(local, dtype=torch.float64)
        self.comm.allreduce_sum_(buf)
        return [math.sqrt(x) for x in buf.tolist()]

    def final_row(self) -> Tensor:
        """The state at t1 in level 0's storage (on the rank that holds it)."""
        fine = self.fine
        return fine.u[fine.row(self._final_point)]

    def norms_and_final(self, local: list[float], like: Tensor) -> tuple[list[float], Tensor]:
        """`norms` and the state at t1 from the rank that holds it, in one reduction
        instead of a reduction and a broadcast: every other rank adds -0.0 to each of its
        values (in float64, which holds every float32 and float16 value exactly), which
        leaves every value as it is, signed zeros included. The reduction's buffer is
        kept per size: this runs at the end of every forward pass, on its critical path
        (the rank that holds the state at t1 is the last to get there)."""
        count = len(local)
        shaped = torch.view_as_real(like) if like.is_complex() else like
        size = count + shaped.numel()
        buf = self._sums.get(size)
        if buf is None:
            buf = self._sums[size] = torch.empty(size, dtype=torch.float64)
        values = buf.numpy()
        values[:count] = local
        if self.comm.rank == self.final_owner:
            value = self.final_row()
            buf[count:].copy_((torch.view_as_real(value) if value.is_complex()
                               else value).reshape(-1))
        else:
            values[count:] = -0.0
        self.comm.allreduce_sum_(buf)
        final = torch.empty_like(like)
        (torch.view_as_real(final) if final.is_complex() else final).copy_(
            buf[count:].view(shaped.shape))
        return [math.sqrt(x) for x in values[:count].tolist()], final

    def broadcast_final(self, like: Tensor) -> Tensor:
        """The state at t1 on every rank, sent from the rank that holds it."""
        final = torch.zeros_like(like)
        if self.comm.rank == self.final_owner:
            final.copy_(self.final_row())
        self.comm.bcast_(final, self.final_owner)
        return final


class History:
    """The residual norms of one solve, reduced over the ranks after every cycle: the solve
    stops at the first that meets the tolerance, and raises at the first that diverges
    (after `drain`, which completes the messages still in flight)."""

    def __init__(self, residuals: Residuals, tol: float, relative: bool, factor: float,
                 drain: Callable[[], None]) -> None:
        self.residuals = residuals
        self.tol, self.relative, self.factor = tol, relative, factor
        self.drain = drain
        self._allreduce_sum = residuals.comm.allreduce_sum     # bound once: called per cycle
        self.norms: list[float] = []
        self.initial: float | None = None     # the guess's, for a relative tolerance
        self.converged = False

    def local(self) -> float:
        """This rank's part of the squared norm of the latest cycle's residual."""
        return self.residuals.local()

    def start(self, local: float) -> None:
        """The guess's residual (this rank's part), after its first F-relaxation."""
        self.initial = self.residuals.norm(local)

    def add(self, local: float) -> None:
        """A cycle's residual (this rank's part)."""
        self.norms.append(math.sqrt(self._allreduce_sum(local)))

    def done(self) -> bool:
        """Whether the last cycle met the tolerance; raises if it diverged."""
        self._check(self.norms)
        threshold = self.tol * self.initial if self.relative else self.tol
        self.converged = self.norms[-1] <= threshold
        return self.converged

    def finish(self, like: Tensor, want_final: bool) -> Tensor | None:
        """The norms are complete; the state at t1 if it came with them (here never)."""
        return None

    def _check(self, norms: list[float]) -> None:
        check_divergence(norms, self.factor, self.drain)


class DeferredHistory(History):
    """The residual norms of a solve that runs all its cycles whatever they are (tol = 0,
    several levels): every cycle's part is kept and all are reduced over the ranks once, at
    the end, so that no cycle waits for every rank to finish the one before; the divergence
    check moves there too, and the state at t1 comes with the norms."""

    def __init__(self, residuals: Residuals, tol: float, relative: bool, factor: float,
                 drain: Callable[[], None]) -> None:
        super().__init__(residuals, tol, relative, factor, drain)
        self.parts: list[float] = []

    def start(self, local: float) -> None:
        self.parts.append(local)

    def add(self, local: float) -> None:
        self.parts.append(local)

    def done(self) -> bool:
        return False

    def finish(self, like: Tensor, want_final: bool) -> Tensor | None:
        final = None
        if want_final and self.residuals.comm.size > 1:
            self.norms, final = self.residuals.norms_and_final(self.parts, like)
        else:
            self.norms = self.residuals.norms(self.parts)
        if self.relative:
            self.initial = self.norms.pop(0)
        self._check(self.norms)
        self.converged = self.norms[-1] <= 0.0
        return final


def check_divergence(norms: list[float], factor: float, drain: Callable[[], None]) -> None:
    """Raise (every rank alike, holding the same norms) at the first cycle whose residual is
    not finite or grew past `factor` times the first cycle's, after `drain`."""
    for k, r in enumerate(norms):
        if not math.isfinite(r) or r > factor * norms[0]:
            drain()
            history = norms[:k + 1]
            raise DivergenceError(
                f"MGRIT diverged: residual {r:.3e} after cycle {k + 1} "
                f"(history {', '.join(f'{x:.3e}' for x in history)}). The usual cause "
                "is an unstable coarse step: forward Euler (a ResNet step) on a coarse "
                "level needs |1 + m^l h xi| < 1 for the eigenvalues xi of its Jacobian; "
                "use fewer levels, a smaller coarsening, or more steps.", history)
