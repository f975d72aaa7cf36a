"""FAS restriction, coarse right-hand side, correction, V- and F-cycles, and solve()."""

from __future__ import annotations

import cmath
import math
import warnings
from dataclasses import dataclass
from numbers import Real
from typing import Any, Callable

import torch
from torch import Tensor

from ..comm import Comm, as_comm
from ..execute import make_executor
from .config import Config
from .grid import build_hierarchy, check_blocks, level0_blocks, local_levels
from .level import Level
from .propagator import Capabilities, Propagator
from .relax import c_relax, f_relax, phi_at, propagate_to_c_points, sweep
from .schedule import Schedule


class DivergenceError(RuntimeError):
    """The residual became NaN/Inf or grew past Config.divergence_factor times its first value.

    `residuals` holds the history up to and including the offending cycle.
    """

    def __init__(self, message: str, residuals: list[float]) -> None:
        super().__init__(message)
        self.residuals = residuals


@dataclass
class Result:
    """Outcome of one MGRIT solve.

    residuals:  residual norm after each cycle (the convention of docs/design.md,
                section 2)
    iterations: cycles done
    converged:  whether the tolerance was met within max_iter cycles
    final:      the state at t1, on every rank (None where the solve was told it is not
                needed, `Solver.solve(..., final=False)`)
    states:     the rank's own level-0 points, first_index..first_index+len-1
    levels:     levels of the hierarchy actually used
    initial_residual: residual of the guess after its first F-relaxation
                (computed for tol_kind="relative", else None)
    """

    residuals: list[float]
    iterations: int
    converged: bool
    final: Tensor | None
    states: Tensor
    first_index: int
    levels: int
    initial_residual: float | None = None


def _check_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite real number, got {value!r}")
    return float(value)


def _warn_below_round_off(config: Config, dtype: torch.dtype) -> None:
    """A relative tolerance that the states' precision cannot reach is a wasted solve: the
    residual stalls at round-off and every one of max_iter cycles runs. Not an error (a
    caller may want max_iter cycles), so a warning, at construction."""
    if config.tol_kind != "relative" or config.tol == 0.0:
        return
    if not (dtype.is_floating_point or dtype.is_complex):
        return
    eps = torch.finfo(dtype).eps
    if config.tol < 10 * eps:
        warnings.warn(f"tol={config.tol:g} (relative) is below what {dtype} states resolve "
                      f"(machine epsilon {eps:.1e}): the residual stalls at round-off, the "
                      f"solve will not converge and runs all max_iter={config.max_iter} "
                      "cycles; use a tolerance above 10 epsilon or a wider dtype",
                      RuntimeWarning, stacklevel=3)


class Solver:
    """MGRIT for one propagator, state shape and time grid; reusable across solves.

    Level storage is allocated once here and reused by every `solve`, whose
    returned `states` are views into it (valid until the next solve). `blocks` gives each
    rank's level-0 points (default: an even split). `final_sweep`, if given, is called with
    True before the last level-0 relaxation of every cycle and with False after that cycle's
    residual: the steps in between are one per fine step, taken from final values (the
    network layer keeps the forward pass's outputs and records parameter gradients there).
    """

    # whether cycles whose phases are all compiled are recorded once and replayed (tests
    # turn it off to compare; the results are the same to the bit)
    replays = True

    def __init__(self, prop: Propagator, like: Tensor, num_steps: int, t0: float, t1: float,
                 config: Config | None = None, comm: Comm | Any = None,
                 blocks: list[tuple[int, int]] | None = None,
                 final_sweep: Callable[[bool], None] | None = None) -> None:
        config = Config() if config is None else config
        if not isinstance(config, Config):
            raise TypeError(f"config must be a mgrit.Config, got {type(config).__name__}")
        if isinstance(num_steps, bool) or not isinstance(num_steps, int):
            raise TypeError(f"num_steps must be an int, got {num_steps!r}")
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        t0 = _check_number("t0", t0)
        t1 = _check_number("t1", t1)
        if t1 == t0:
            raise ValueError(f"t1 must differ from t0, both are {t0}")
        caps = Capabilities.of(prop)
        if final_sweep is not None and not callable(final_sweep):
            raise TypeError(f"final_sweep must be callable, got {type(final_sweep).__name__}")
        if not isinstance(like, Tensor):
            raise TypeError(f"u0 must be a torch.Tensor, got {type(like).__name__}")
        self.prop = prop
        self.caps = caps
        self._final_sweep_hook = final_sweep
        self.config = config
        self.num_steps = num_steps
        self.t0, self.t1 = t0, t1
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device
        _warn_below_round_off(config, like.dtype)
        self.executor = make_executor(config.execution, caps, config.cuda_graphs,
                                      type(prop).__name__)
        self.comm = as_comm(comm)
        if isinstance(config.initial_guess, Tensor):
            self._check_guess(config.initial_guess)
        self.comm.agree("solver settings (num_steps, t0, t1, state shape, dtype, config)",
                        (num_steps, t0, t1, tuple(like.shape), str(like.dtype),
                         tuple(sorted(config.describe().items()))))
        grids = build_hierarchy(num_steps, config.coarsening_list(), config.levels,
                                config.min_coarse)
        if blocks is None:
            blocks = level0_blocks(grids, self.comm.size)
        elif len(blocks) != self.comm.size:
            raise ValueError(f"blocks lists {len(blocks)} ranks, the communicator has "
                             f"{self.comm.size}")
        check_blocks(blocks, num_steps + 1)
        self.blocks = list(blocks)
        h = (t1 - t0) / num_steps
        self.levels = [Level(local, like, self.comm, t0, h, fas=local.grid.level > 0)
                       for local in local_levels(grids, self.comm.size, self.comm.rank, blocks)]
        self._has_solved = False
        self._transfers: dict[int, _Transfer] = {}
        self._phi_cache: tuple[int, Tensor] | None = None
        self._final_owner = next(r for r, (a, b) in enumerate(blocks) if a <= num_steps <= b)
        self._step_checked = False
        # cycles recorded and replayed (`mgrit.core.schedule`) where every phase may be one
        # compiled call; `_recording` is the record being made, else None
        self._records = (self.replays and self.executor.compiles and
                         self.executor.graphs is None and caps.program_key is not None
                         and caps.step_program is not None)
        self._schedule: Schedule | None = None
        self._recording: Schedule | None = None
        # the record of a cycle that could not be replayed (a phase ran step by step): while
        # its keys hold, cycles run as they are, not recorded again each time
        self._declined: Schedule | None = None
        # the fine C-points' rows and a buffer for their residual (`_local_residual`)
        self._residual_views: tuple[Tensor, Tensor] | None = None

    # input checks ------------------------------------------------------------
    def _check_guess(self, guess: Tensor) -> None:
        expected = (self.num_steps + 1, *self.shape)
        if tuple(guess.shape) != expected or guess.dtype != self.dtype:
            raise ValueError(f"initial_guess tensor has shape {tuple(guess.shape)} and dtype "
                             f"{guess.dtype}; expected shape {expected} (num_steps + 1 points) "
                             f"and dtype {self.dtype}")

    def _check_u0(self, u0: Tensor) -> None:
        if not isinstance(u0, Tensor):
            raise TypeError(f"u0 must be a torch.Tensor, got {type(u0).__name__}")
        if u0.shape != self.shape or u0.dtype != self.dtype:
            raise ValueError(f"u0 has shape {tuple(u0.shape)} and dtype {u0.dtype}; this solver "
                             f"was built for shape {tuple(self.shape)} and dtype {self.dtype}")
        # a NaN or Inf anywhere makes the sum one (one reduction and a read, where the
        # exact test takes three calls); a sum of finite values may overflow, so a sum
        # that is not finite is checked entry by entry
        if not cmath.isfinite(u0.sum().item()) and not bool(torch.isfinite(u0).all()):
            raise ValueError("u0 contains NaN or Inf")

    def _check_step(self, u0: Tensor) -> None:
        """One fine step on u0 (the first step this rank takes) must keep shape and dtype."""
        fine = self.levels[0]
        if fine.empty or fine.last == 0:   # no point, or point 0 alone: this rank takes no step
            return
        out = self.caps.step(u0, fine.step(max(fine.first - 1, 0)))
        if not isinstance(out, Tensor) or out.shape != u0.shape or out.dtype != u0.dtype:
            got = (f"shape {tuple(out.shape)}, dtype {out.dtype}" if isinstance(out, Tensor)
                   else type(out).__name__)
            raise TypeError(f"{type(self.prop).__name__}.step returned {got} for a state of "
                            f"shape {tuple(u0.shape)}, dtype {u0.dtype}; it must keep both")
        self._step_checked = True

    # set-up of one solve -----------------------------------------------------
    def _initialize(self, u0: Tensor, guess: str | Tensor) -> None:
        self._phi_cache = None
        for level in self.levels:
            level.drain()
            if level.index > 0:
                level.u.zero_()
                level.g.zero_()
        fine = self.levels[0]
        if isinstance(guess, Tensor):
            if not fine.empty:
                fine.u[1:] = guess[fine.first: fine.last + 1]
                if fine.first > 0:
                    fine.u[0] = guess[fine.first - 1]
        elif guess != "warm" or not self._has_solved:
            fine.u.zero_()
        for level in self.levels:
            if level.initial_row is not None:
                level.initial_row.copy_(u0)

    # the cycle -----------------------------------------------------------------
    def _transfer(self, l: int) -> "_Transfer":
        """The views between levels l and l+1 that restriction and correction read and write
        (made at their first use: level storage is never reallocated)."""
        views = self._transfers.get(l)
        if views is None:
            views = self._transfers[l] = _Transfer(self.levels[l], self.levels[l + 1])
        return views

    def _restrict(self, l: int) -> None:
        """Inject level l's C-points into level l+1 and form its FAS right-hand side."""
        fine, coarse = self.levels[l], self.levels[l + 1]
        coarse.drain()
        if coarse.empty:
            return
        views = self._transfer(l)
        run = _call if self._recording is None else self._recording.call
        coarse.post_v_ghost()
        run(views.coarse_v.copy_, views.fine_u)
        coarse.publish_v()
        if views.count:
            if l == 0 and self._recording is not None:
                phi = self._recording.call(self._phi_into, fine, views)
            else:
                phi = self._phi_at_c_points(fine, views.first_c, views.count)
            residual = views.residual
            if views.fine_g_c is None:
                run(torch.sub, phi, views.fine_u_c, out=residual)
            else:
                run(torch.sub, views.fine_g_c, views.fine_u_c, out=residual)
                run(residual.add_, phi)
            if views.j0 == coarse.first:
                coarse.wait_v_ghost()
            phi_coarse = phi_at(coarse, self.executor, coarse.v, views.j0 - 1, 1, views.count)
            run(torch.add, residual, views.coarse_v_c, out=views.coarse_g_c)
            run(views.coarse_g_c.sub_, phi_coarse)
        coarse.wait_v_ghost()
        run(coarse.u.copy_, coarse.v)

    def _phi_into(self, fine: Level, views: "_Transfer") -> Tensor:
        """Phi at level 0's C-points (cached, `_phi_at_c_points`) in one tensor whatever
        computed it, for a recorded cycle: the calls recorded after it read that tensor."""
        phi = self._phi_at_c_points(fine, views.first_c, views.count)
        if views.phi is None:
            views.phi = phi
        elif phi is not views.phi:
            views.phi.copy_(phi)
        return views.phi

    def _update_c_points(self, l: int, correct: bool) -> None:
        """Level l's C-points from level l+1: add the correction (u_c - v), or inject u_c."""
        fine, coarse = self.levels[l], self.levels[l + 1]
        if fine.empty:
            return
        fine.post_ghost(c_phase=True)
        if not coarse.empty:
            views = self._transfer(l)
            run = _call if self._recording is None else self._recording.call
            if correct:
                run(torch.sub, views.coarse_u, views.coarse_v, out=views.correction)
                run(views.fine_u.add_, views.correction)
            else:
                run(views.fine_u.copy_, views.coarse_u)
        fine.changed(c_phase=True)

    def _final_sweep(self, active: bool) -> None:
        """Call the `final_sweep` hook, if any: the final sweep of level 0 begins (True) or,
        after the residual, ends (False)."""
        hook = self._final_sweep_hook
        if hook is None:
            return
        if self._recording is None:
            hook(active)
        else:
            self._recording.hook(hook, active)

    def _run_cycle(self) -> None:
        """One cycle from level 0: replayed where a valid record of one exists, recorded
        where the solver records cycles, else run (`mgrit.core.schedule`)."""
        kind = self.config.cycle
        schedule = self._schedule
        if schedule is not None:
            if schedule.valid():
                schedule.replay()
                return
            self._schedule = None
        declined = self._declined
        if not self._records or (declined is not None and declined.valid()):
            self._cycle(0, kind, first_f=False)
            return
        self._declined = None
        schedule = self._recording = Schedule(self.caps.program_key)
        for level in self.levels:
            level.recorder = schedule
        try:
            self._cycle(0, kind, first_f=False)
        finally:
            self._recording = None
            for level in self.levels:
                level.recorder = None
        if schedule.replayable:
            self._schedule = schedule
        else:
            self._declined = schedule

    def _cycle(self, l: int, kind: str, first_f: bool) -> None:
        level = self.levels[l]
        if level.grid.is_coarsest:
            if l == 0:
                self._final_sweep(True)
            sweep(level, self.executor)
            return
        if first_f:
            f_relax(level, self.executor)
        for _ in range(self.config.cf_sweeps_at(l)):
            c_relax(level, self.executor, self.config.c_weight)
            f_relax(level, self.executor)
        self._restrict(l)
        self._cycle(l + 1, kind, True)
        self._update_c_points(l, correct=True)
        if l == 0:
            self._final_sweep(True)
        f_relax(level, self.executor)
        if l > 0 and kind == "F":
            self._cycle(l, "V", False)

    def _nested(self) -> None:
        """Solve the coarsest level, then inject level by level with one V-cycle each."""
        sweep(self.levels[-1], self.executor)
        for l in range(len(self.levels) - 2, -1, -1):
            self._update_c_points(l, correct=False)
            if l > 0:
                self._cycle(l, "V", True)

    def _phi_at_c_points(self, level: Level, first_c: int, count: int) -> Tensor:
        """Phi(u_{c-1}) at the rank's C-points of level 0, reused while u is unchanged: with
        F-relaxation the residual after a cycle and the next restriction need the same values."""
        if level.index > 0:
            return propagate_to_c_points(level, self.executor, first_c, count)
        cached = self._phi_cache
        if cached is not None and cached[0] == level.version:
            return cached[1]
        phi = propagate_to_c_points(level, self.executor, first_c, count)
        self._phi_cache = (level.version, phi)
        return phi

    def _residual(self) -> float:
        """2-norm over the fine C-points j >= 1 of Phi(u_{j-1}) - u_j, over all ranks."""
        return math.sqrt(self.comm.allreduce_sum(self._local_residual()))

    def _local_residual(self) -> float:
        """This rank's part of the squared residual norm."""
        fine = self.levels[0]
        if fine.empty or fine.grid.is_coarsest:
            return 0.0
        first_c, count = fine.c_points()
        if not count:
            return 0.0
        phi = self._phi_at_c_points(fine, first_c, count)
        views = self._residual_views
        if views is None:
            # level storage is never reallocated: the C-points' rows and the difference's
            # buffer are made once
            u_c = fine.u[fine.rows(first_c, fine.grid.coarsening, count)]
            views = self._residual_views = (u_c, torch.empty_like(u_c))
        torch.sub(phi, views[0], out=views[1])
        return float(torch.linalg.vector_norm(views[1])) ** 2

    def _residuals(self, local: list[float]) -> list[float]:
        """Residual norms from every rank's parts, all in one reduction."""
        if self.comm.size == 1:
            return [math.sqrt(x) for x in local]
        buf = torch.tensor(local, dtype=torch.float64)
        self.comm.allreduce_sum_(buf)
        return [math.sqrt(x) for x in buf.tolist()]

    def _final_row(self) -> Tensor:
        """The state at t1 in level 0's storage (on the rank that holds it)."""
        fine = self.levels[0]
        return fine.u[fine.row(self.num_steps)]

    def _residuals_and_final(self, local: list[float], like: Tensor) -> tuple[list[float],
                                                                             Tensor]:
        """`_residuals` and the state at t1 from the rank that holds it, in one reduction
        instead of a reduction and a broadcast: every other rank adds -0.0 to each of its
        values (in float64, which holds every float32 and float16 value exactly), which
        leaves every value as it is, signed zeros included."""
        count = len(local)
        shaped = torch.view_as_real(like) if like.is_complex() else like
        buf = torch.full((count + shaped.numel(),), -0.0, dtype=torch.float64)
        buf[:count] = torch.tensor(local, dtype=torch.float64)
        if self.comm.rank == self._final_owner:
            value = self._final_row()
            buf[count:] = (torch.view_as_real(value) if value.is_complex() else value).reshape(-1)
        self.comm.allreduce_sum_(buf)
        final = torch.empty_like(like)
        (torch.view_as_real(final) if final.is_complex() else final).copy_(
            buf[count:].view(shaped.shape))
        return [math.sqrt(x) for x in buf[:count].tolist()], final

    def _check_divergence(self, residuals: list[float]) -> None:
        """Raise (every rank alike) at the first cycle whose residual is not finite or grew
        past divergence_factor times the first cycle's."""
        for k, r in enumerate(residuals):
            if not math.isfinite(r) or r > self.config.divergence_factor * residuals[0]:
                self._drain()
                history = residuals[:k + 1]
                raise DivergenceError(
                    f"MGRIT diverged: residual {r:.3e} after cycle {k + 1} "
                    f"(history {', '.join(f'{x:.3e}' for x in history)}). The usual cause "
                    "is an unstable coarse step: forward Euler (a ResNet step) on a coarse "
                    "level needs |1 + m^l h xi| < 1 for the eigenvalues xi of its Jacobian; "
                    "use fewer levels, a smaller coarsening, or more steps.", history)

    def fine_states(self) -> tuple[Tensor, int]:
        """The rank's level-0 storage and the point its first row holds.

        Row 0 is the previous rank's last point (valid after a solve), rows 1.. the
        rank's own points: the linearisation states a backward pass needs.
        """
        fine = self.levels[0]
        return fine.u, fine.first - 1

    @property
    def has_solved(self) -> bool:
        """Whether a solve has left states that `initial_guess="warm"` starts from."""
        return self._has_solved

    def warm_states(self) -> Tensor | None:
        """A copy of what the next warm-started solve starts from (the rank's level-0 rows,
        as `fine_states` lays them out), or None before the first solve: what a checkpoint
        keeps so that a resumed run continues exactly."""
        return self.levels[0].u.clone() if self._has_solved else None

    def set_warm_states(self, rows: Tensor) -> None:
        """Start the next warm-started solve from `rows` (what `warm_states` returned)."""
        fine = self.levels[0].u
        if rows.shape != fine.shape or rows.dtype != fine.dtype:
            raise ValueError(f"warm states of shape {tuple(rows.shape)}, {rows.dtype} do not "
                             f"fit this solver's {tuple(fine.shape)}, {fine.dtype}")
        fine.copy_(rows)
        self._has_solved = True

    def _drain(self) -> None:
        for level in self.levels:
            level.drain()

    # the solve -----------------------------------------------------------------
    def solve(self, u0: Tensor, final: bool = True) -> Result:
        """Run cycles from the configured initial guess until converged or max_iter.
        `final=False`: the state at t1 is not needed (`Result.final` is None), so it is not
        broadcast from its rank, a collective less at the end of the solve. (A solve of a
        fixed number of cycles, tol = 0, sends it with its residual norms, in the one
        reduction it ends with.)"""
        try:
            return self._solve(u0, final)
        except Exception as err:
            if self.comm.size > 1:
                err.add_note(f"mgrit: raised on rank {self.comm.rank} of {self.comm.size}")
            raise

    def _solve(self, u0: Tensor, want_final: bool) -> Result:
        cfg = self.config
        self._check_u0(u0)
        if not self._step_checked:
            self._check_step(u0)
        self._initialize(u0, cfg.initial_guess)
        if cfg.initial_guess == "nested" and len(self.levels) > 1:
            self._nested()
        # With tol = 0 a multilevel solve runs all its cycles whatever the residuals are:
        # their norms are reduced over the ranks once, at the end, so that no cycle waits
        # for every rank to finish the one before (the divergence check moves there too).
        deferred = cfg.tol == 0.0 and len(self.levels) > 1
        residuals: list[float] = []
        parts: list[float] = []
        initial = None
        converged = False
        for iteration in range(cfg.max_iter):
            if iteration == 0 and len(self.levels) > 1:
                f_relax(self.levels[0], self.executor)
            if iteration == 0 and cfg.tol_kind == "relative":
                if deferred:
                    parts.append(self._local_residual())
                else:
                    initial = self._residual()
            self._run_cycle()
            if deferred:
                parts.append(self._local_residual())
                self._final_sweep(False)
                continue
            r = self._residual()
            self._final_sweep(False)
            residuals.append(r)
            self._check_divergence(residuals)
            threshold = cfg.tol * initial if cfg.tol_kind == "relative" else cfg.tol
            if r <= threshold:
                converged = True
                break
        final = None
        if deferred:
            if want_final and self.comm.size > 1:
                residuals, final = self._residuals_and_final(parts, u0)
            else:
                residuals = self._residuals(parts)
            if cfg.tol_kind == "relative":
                initial = residuals.pop(0)
            self._check_divergence(residuals)
            converged = residuals[-1] <= 0.0
        self._drain()
        self._has_solved = True
        fine = self.levels[0]
        if want_final and final is None:
            final = torch.zeros_like(u0)
            if self.comm.rank == self._final_owner:
                final.copy_(self._final_row())
            self.comm.bcast_(final, self._final_owner)
        return Result(residuals=residuals, iterations=len(residuals), converged=converged,
                      final=final, states=fine.u[1:], first_index=fine.first,
                      levels=len(self.levels), initial_residual=initial)


class _Transfer:
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


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def solve(prop: Propagator, u0: Tensor, num_steps: int, t0: float, t1: float,
          config: Config | None = None, comm: Comm | Any = None) -> Result:
    """Solve u_{n+1} = Phi_n(u_n), n = 0..num_steps-1, on [t0, t1] with MGRIT.

    `comm=None` solves in this process; a communicator spreads the time points
    over its ranks (every rank calls solve with the same arguments).
    """
    return Solver(prop, u0, num_steps, t0, t1, config, comm).solve(u0)
