"""The solver: V- and F-cycles over the levels and the solve that repeats them (docs/solver.md).

What a cycle does between levels is its operations object's (`mgrit.core.transfer`), the
residual norms and their reductions are `mgrit.core.residual`'s, and the record and replay
of whole cycles `mgrit.core.schedule`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import Tensor

from ..comm import Comm, as_comm, note_rank
from ..execute import make_executor
from .agglomerate import Gathered, first_gathered
from .checks import (check_guess, check_number, check_step, check_u0,
                     warn_below_round_off)
from .config import Config
from .device_history import DeviceHistory
from .grid import build_hierarchy, check_blocks, level0_blocks, local_levels
from .level import Level
from .propagator import Capabilities, Propagator
from .relax import c_relax, f_relax, sweep
from .residual import DeferredHistory, DivergenceError, History, Residuals
from .schedule import Replays, Schedule
from .transfer import Operations

__all__ = ["DivergenceError", "Result", "Solver", "solve"]


@dataclass
class Result:
    """Outcome of one MGRIT solve.

    residuals:  residual norm after each cycle (the convention of docs/design.md,
                section 2); a captured solve's are a float64 device tensor
                (`mgrit.core.device_history`), its `initial_residual` a scalar of it
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
    # a solve that a CUDA graph can hold: no host reads, a fixed number of cycles, the
    # residual norms kept on the device (`mgrit.core.device_history`)
    captured = False

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
        t0 = check_number("t0", t0)
        t1 = check_number("t1", t1)
        if t1 == t0:
            raise ValueError(f"t1 must differ from t0, both are {t0}")
        caps = Capabilities.of(prop)
        if config.agglomerate and caps.local_steps and caps.gather_steps is None:
            raise ValueError(
                f"Config(agglomerate={config.agglomerate}) solves coarse levels on every "
                f"rank, but the steps of {type(prop).__name__} read data only their own rank "
                "holds (its local_steps is True) and it cannot fetch it (it has no "
                "gather_steps(grids, comm)): use agglomerate=0 with it")
        if final_sweep is not None and not callable(final_sweep):
            raise TypeError(f"final_sweep must be callable, got {type(final_sweep).__name__}")
        if not isinstance(like, Tensor):
            raise TypeError(f"u0 must be a torch.Tensor, got {type(like).__name__}")
        self.prop = prop
        self.caps = caps
        self.config = config
        self.num_steps = num_steps
        self.t0, self.t1 = t0, t1
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device
        warn_below_round_off(config, like.dtype)
        self.executor = make_executor(config.execution, caps, config.cuda_graphs,
                                      type(prop).__name__)
        self.comm = as_comm(comm)
        if isinstance(config.initial_guess, Tensor):
            check_guess(config.initial_guess, num_steps, like.shape, like.dtype)
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
        self._step_checked = False
        final_owner = next(r for r, (a, b) in enumerate(blocks) if a <= num_steps <= b)
        self._residuals = Residuals(self.levels[0], self.executor, self.comm, final_owner,
                                    num_steps)
        self._ops = Operations(self.levels, self.executor, self._residuals, final_sweep)
        # the coarse levels every rank solves after one gather (`Config.agglomerate`)
        first = first_gathered([level.grid for level in self.levels], self.comm.size,
                               config.agglomerate)
        self._gathered = (None if first is None else
                          Gathered(self.levels, first, like, self.executor, self._residuals,
                                   self.comm))
        if self._gathered is not None and caps.gather_steps is not None:
            caps.gather_steps([level.grid for level in self._gathered.ops.levels[first:]],
                              self.comm)
        # cycles recorded and replayed (`mgrit.core.schedule`) where every phase may be one
        # compiled call
        self._replays = Replays(self.levels,
                                self.replays and self.executor.compiles
                                and self.executor.graphs is None
                                and caps.program_key is not None
                                and caps.step_program is not None)

    @property
    def _schedule(self) -> Schedule | None:
        """The record of a cycle that later cycles replay, if any."""
        return self._replays.schedule

    @property
    def _recording(self) -> Schedule | None:
        """The record being made, if a cycle is being recorded."""
        return self._replays.current

    @property
    def _final_owner(self) -> int:
        """The rank that holds the state at t1."""
        return self._residuals.final_owner

    # set-up of one solve -----------------------------------------------------
    def _initialize(self, u0: Tensor, guess: str | Tensor) -> None:
        self._residuals.forget()
        for level in self.levels:
            level.boundary.drain()
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
    def _run_cycle(self) -> None:
        """One cycle from level 0: replayed where a valid record of one exists, recorded
        where the solver records cycles, else run (`mgrit.core.schedule`)."""
        replays = self._replays
        if replays.replay():
            return
        if not replays.records():
            self._cycle(self._ops, 0, self.config.cycle, first_f=False)
            return
        with replays.recording(self.caps.program_key) as schedule:
            self._cycle(self._ops.recorded(schedule), 0, self.config.cycle, first_f=False)

    def _cycle(self, ops: Operations, l: int, kind: str, first_f: bool) -> None:
        """A V- or F-cycle from level l (docs/solver.md), its operations between levels
        made through `ops` on its levels (`ops.levels`: the solver's, or the gathered
        copies of `mgrit.core.agglomerate`)."""
        level = ops.levels[l]
        if level.grid.is_coarsest:
            if l == 0:
                ops.final_sweep(True)
            sweep(level, self.executor)
            return
        if first_f:
            f_relax(level, self.executor)
        for _ in range(self.config.cf_sweeps_at(l)):
            c_relax(level, self.executor, self.config.c_weight)
            f_relax(level, self.executor)
        ops.restrict(l)
        gathered = self._gathered
        if gathered is not None and l + 1 == gathered.first:
            ops.run(gathered.solve, self._cycle, kind)
        else:
            self._cycle(ops, l + 1, kind, True)
        ops.update_c_points(l, correct=True)
        if l == 0:
            ops.final_sweep(True)
        f_relax(level, self.executor)
        if l > 0 and kind == "F":
            self._cycle(ops, l, "V", False)

    def _nested(self, u0: Tensor) -> None:
        """Solve the coarsest level, then inject level by level with one V-cycle each; the
        gathered levels (`Config.agglomerate`) on every rank's copies of them, which need no
        message but the rank's own u0."""
        ops = self._ops
        gathered = self._gathered
        if gathered is None:
            sweep(self.levels[-1], self.executor)
            below = len(self.levels) - 2
        else:
            gathered.nested(u0, self._cycle)
            below = gathered.first - 1
        for l in range(below, -1, -1):
            ops.update_c_points(l, correct=False)
            if l > 0:
                self._cycle(ops, l, "V", True)

    # residuals -------------------------------------------------------------------
    def _local_residual(self, history: History) -> Any:
        """This rank's part of the squared residual norm, as `history` keeps it: a float
        (`Residuals.local`) or, in a captured solve, a device scalar."""
        return history.local()

    def _final_row(self) -> Tensor:
        """The state at t1 in level 0's storage (on the rank that holds it)."""
        return self._residuals.final_row()

    def _residuals_and_final(self, local: list[float], like: Tensor
                             ) -> tuple[list[float], Tensor]:
        """Every cycle's residual norm and the state at t1, in one reduction."""
        return self._residuals.norms_and_final(local, like)

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
            level.boundary.drain()

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
            note_rank(err, self.comm)
            raise

    def _solve(self, u0: Tensor, want_final: bool) -> Result:
        """Cycles from the initial guess until the residual history stops them: converged,
        diverged (raised), or max_iter cycles done (docs/solver.md)."""
        cfg = self.config
        check_u0(u0, self.shape, self.dtype, finite=not self.captured)
        if not self._step_checked:
            check_step(self.caps, type(self.prop).__name__, self.levels[0], u0)
            self._step_checked = True
        self._initialize(u0, cfg.initial_guess)
        multilevel = len(self.levels) > 1
        if cfg.initial_guess == "nested" and multilevel:
            self._nested(u0)
        # with tol = 0 a multilevel solve runs all its cycles whatever the residuals are:
        # their norms are reduced once, at the end (`DeferredHistory`)
        kind = DeferredHistory if cfg.tol == 0.0 and multilevel else History
        if self.captured:
            kind = DeviceHistory
        history = kind(self._residuals, cfg.tol, cfg.tol_kind == "relative",
                       cfg.divergence_factor, self._drain)
        # no cycle means the nested start F-relaxed once; where the layers gave a single
        # level, there is no start to relax and the solve is its one sweep
        cycles = cfg.max_iter if cfg.max_iter or multilevel else 1
        for iteration in range(cycles):
            if iteration == 0 and multilevel:
                f_relax(self.levels[0], self.executor)
            if iteration == 0 and history.relative:
                history.start(self._local_residual(history))
            self._run_cycle()
            history.add(self._local_residual(history))
            self._ops.final_sweep(False)
            if history.done():
                break
        if cfg.max_iter == 0 and multilevel:
            # no cycle: the nested start relaxed once (Config allows 0 cycles only from
            # there); as the last sweep of a cycle, it and the residual that follows are
            # the solve's final sweep
            self._ops.final_sweep(True)
            f_relax(self.levels[0], self.executor)
            history.add(self._local_residual(history))
            self._ops.final_sweep(False)
        final = history.finish(u0, want_final)
        self._drain()
        self._has_solved = True
        if want_final and final is None:
            final = self._residuals.broadcast_final(u0)
        fine = self.levels[0]
        return Result(residuals=history.norms, iterations=len(history.norms),
                      converged=history.converged, final=final, states=fine.u[1:],
                      first_index=fine.first, levels=len(self.levels),
                      initial_residual=history.initial)


def solve(prop: Propagator, u0: Tensor, num_steps: int, t0: float, t1: float,
          config: Config | None = None, comm: Comm | Any = None) -> Result:
    """Solve u_{n+1} = Phi_n(u_n), n = 0..num_steps-1, on [t0, t1] with MGRIT.

    `comm=None` solves in this process; a communicator spreads the time points
    over its ranks (every rank calls solve with the same arguments).
    """
    return Solver(prop, u0, num_steps, t0, t1, config, comm).solve(u0)
