"""What a setting costs: a model of one solve's time on the critical path, so that settings
are priced alike on every rank and in every rerun."""

from __future__ import annotations

import math

from ...core.config import Config
from ...core.grid import build_hierarchy

# A batched call advances this many intervals for the price of one more single-step call:
# calls cost a fixed overhead plus their work, and narrow layers are overhead-bound. Fitted to
# dense tanh layers of width 32 at batch 32 on one CPU core and 1024 layers, where exact
# stepping takes 1.7 times as long as 2/1 cycles at 5 levels, and matching the digits' 32
# layers (1.7 times the other way round). Larger layers batch less well (a smaller value),
# a GPU's calls cost more than their work (a larger one).
BATCHING = 6.0


def solve_cost(config: Config, num_steps: int, ranks: int,
               batching: float = BATCHING) -> float:
    """A model of one MGRIT solve's time on the critical path, in single-step calls: a
    relaxation's batched call over n intervals costs 1 + ceil(n / ranks) / batching (each
    rank advances its share), a sequential march (the coarsest level, or exact stepping with
    levels=1) one call per step of the whole level, whichever rank holds it. Deterministic,
    so that every rank and every rerun prices a setting alike; communication is left out."""
    grids = build_hierarchy(num_steps, config.coarsening_list(), config.levels,
                            config.min_coarse)

    def call(points: int) -> float:
        return 1.0 + math.ceil(points / ranks) / batching

    def march(level: int) -> float:
        return grids[level].num_steps * (1.0 + 1.0 / batching)

    if len(grids) == 1:
        return config.max_iter * march(0)

    def visit(level: int, leading_f: bool) -> float:
        """One V-cycle from `level`: its relaxation, restriction, the coarser levels and
        the correction with its final F-relaxation."""
        m, intervals = grids[level].coarsening, grids[level + 1].num_steps
        f_relax = (m - 1) * call(intervals)
        cost = f_relax if leading_f else 0.0
        cost += config.cf_sweeps_at(level) * (call(intervals) + f_relax)
        cost += 2 * call(intervals)        # the fine residual and the coarse operator
        cost += visit(level + 1, True) if level + 2 < len(grids) else march(level + 1)
        cost += f_relax                    # after the correction
        if level > 0 and config.cycle == "F":
            cost += visit(level, False)
        return cost

    fine_f = (grids[0].coarsening - 1) * call(grids[1].num_steps)
    return fine_f + config.max_iter * visit(0, False)
