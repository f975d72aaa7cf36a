"""What a setting costs: a model of one solve's time on the critical path, so that settings
are priced alike on every rank and in every rerun.

The model counts what lies on the path (`solve_terms`): batched relaxation calls and the
intervals a rank advances in them, the steps of the sequential coarsest-level march, and
the hops (messages the path waits for). A price per term turns the counts into a cost:
`solve_cost` prices them in single-step calls with a fixed batching gain, `solve_seconds`
in seconds from a `Calibration` measured on the network's own layers (`calibrate`), with a
latency per hop, so that many ranks favour more levels (a shorter coarse chain) and one rank
fewer (fewer calls).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from ...core.config import Config
from ...core.grid import build_hierarchy

# A batched call advances this many intervals for the price of one more single-step call:
# calls cost a fixed overhead plus their work, and narrow layers are overhead-bound. Fitted to
# dense tanh layers of width 32 at batch 32 on one CPU core and 1024 layers, where exact
# stepping takes 1.7 times as long as 2/1 cycles at 5 levels, and matching the digits' 32
# layers (1.7 times the other way round). Larger layers batch less well (a smaller value),
# a GPU's calls cost more than their work (a larger one).
BATCHING = 6.0

# Seconds one hop adds to the path where none is measured: about 40 us on mgrit's own
# kernels at 64 ranks, most of it Python frames around the message (docs/scaling.md).
LATENCY = 40e-6


class Terms(NamedTuple):
    """What one solve puts on the critical path: batched `calls`, the `intervals` a rank
    advances in them (each call's share, ceil(points / ranks), summed), the sequential
    `steps` of marches, and `hops`."""

    calls: int
    intervals: int
    steps: int
    hops: int


def _ranks_holding(points: int, ranks: int) -> int:
    return max(1, min(points, ranks))


def _log2(ranks: int) -> int:
    return math.ceil(math.log2(ranks)) if ranks > 1 else 0


def solve_terms(config: Config, num_steps: int, ranks: int) -> Terms:
    """The critical path of one solve with `config` over `num_steps` layers on `ranks`
    ranks, counted (`Terms`). A relaxation phase on a level whose points lie on more than
    one rank waits for one message; the coarsest level's march (or exact stepping's, with
    levels=1) passes through every rank holding its points; a solve ends with one
    reduction over the ranks (log2 hops)."""
    grids = build_hierarchy(num_steps, config.coarsening_list(), config.levels,
                            config.min_coarse)
    calls = intervals = steps = hops = 0

    def phase(count: int, points: int) -> None:
        """`count` batched calls over `points` intervals, after one message."""
        nonlocal calls, intervals, hops
        calls += count
        intervals += count * math.ceil(points / ranks)
        hops += 1 if count and _ranks_holding(points, ranks) > 1 else 0

    def march(level: int) -> None:
        nonlocal steps, hops
        steps += grids[level].num_steps
        hops += _ranks_holding(grids[level].num_steps, ranks) - 1

    def visit(level: int, leading_f: bool, kind: str) -> None:
        """One cycle of `kind` from `level`: its relaxation, restriction, the coarser levels
        and the correction with its final F-relaxation (an F-cycle then runs a V-cycle
        from each level below the fine one, as the solver does)."""
        m, points = grids[level].coarsening, grids[level + 1].num_steps
        if leading_f:
            phase(m - 1, points)
        for _ in range(config.cf_sweeps_at(level)):
            phase(1, points)                # C-relaxation
            phase(m - 1, points)            # F-relaxation
        phase(2, points)                    # the fine residual and the coarse operator
        if level + 2 < len(grids):
            visit(level + 1, True, kind)
        else:
            march(level + 1)
        phase(m - 1, points)                # after the correction
        if level > 0 and kind == "F":
            visit(level, False, "V")

    if len(grids) == 1:
        for _ in range(config.max_iter):
            march(0)
        return Terms(calls, intervals, steps, hops + _log2(ranks))
    if config.initial_guess == "nested":
        # the coarsest level's march, then a V-cycle from each level between it and the
        # fine one: what the solver does before its first cycle (`Solver._nested`)
        march(len(grids) - 1)
        for level in range(len(grids) - 2, 0, -1):
            visit(level, True, "V")
    phase(grids[0].coarsening - 1, grids[1].num_steps)
    for _ in range(config.max_iter):
        visit(0, False, config.cycle)
    return Terms(calls, intervals, steps, hops + _log2(ranks))


def solve_cost(config: Config, num_steps: int, ranks: int,
               batching: float = BATCHING) -> float:
    """A model of one MGRIT solve's time on the critical path, in single-step calls: a
    relaxation's batched call over n intervals costs 1 + ceil(n / ranks) / batching (each
    rank advances its share), a sequential march (the coarsest level, or exact stepping with
    levels=1) one call per step of the whole level, whichever rank holds it. Deterministic,
    so that every rank and every rerun prices a setting alike; communication is left out
    (`solve_seconds` prices it)."""
    t = solve_terms(config, num_steps, ranks)
    return t.calls + t.intervals / batching + t.steps * (1.0 + 1.0 / batching)


@dataclass(frozen=True)
class Units:
    """Seconds of the pieces of one pass on one rank: a batched call's fixed cost (`call`),
    each interval it advances (`interval`), and one step of a sequential march (`step`)."""

    call: float
    interval: float
    step: float

    def price(self, terms: Terms, latency: float) -> float:
        return (self.call * terms.calls + self.interval * terms.intervals
                + self.step * terms.steps + latency * terms.hops)


@dataclass(frozen=True)
class Calibration:
    """What the pieces of the forward and the adjoint solve cost on this machine for this
    network (`calibrate` measures them, `fit` derives them from timed solves), and the
    seconds a hop adds to the path. The same numbers on every rank give the same prices."""

    forward: Units
    backward: Units
    latency: float = LATENCY

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> Calibration:
        return cls(Units(**state["forward"]), Units(**state["backward"]), state["latency"])


def solve_seconds(config: Config, num_steps: int, ranks: int, units: Units,
                  latency: float = LATENCY) -> float:
    """The modelled seconds of one solve's critical path on `ranks` ranks, from measured
    `units` and a `latency` per hop (`solve_terms`)."""
    return units.price(solve_terms(config, num_steps, ranks), latency)


def step_seconds(forward: Config, backward: Config, num_steps: int, ranks: int,
                 calibration: Calibration) -> float:
    """The modelled seconds of a training step's two solves."""
    c = calibration
    return (solve_seconds(forward, num_steps, ranks, c.forward, c.latency)
            + solve_seconds(backward, num_steps, ranks, c.backward, c.latency))


def fit(samples: list[tuple[Terms, float]], latency: float = LATENCY) -> Units:
    """The `Units` that best explain timed solves (`samples`: each solve's `Terms` and its
    seconds), in relative terms (each solve's misfit over its own time, so that a short
    solve counts as much as a long one), none negative. The hops' share is taken off at
    `latency` first. Deterministic: the same samples give the same units."""
    if not samples:
        raise ValueError("fit needs at least one timed solve")
    rows = [[float(t.calls), float(t.intervals), float(t.steps)] for t, _ in samples]
    targets = [max(seconds - latency * t.hops, 0.0) for t, seconds in samples]
    weights = [1.0 / seconds if seconds > 0 else 1.0 for _, seconds in samples]
    best: tuple[float, list[float]] | None = None
    # least squares on every subset of the three unknowns, keeping the best whose values
    # are all positive: three unknowns make eight small problems, exact and repeatable
    for mask in range(1, 8):
        used = [k for k in range(3) if mask >> k & 1]
        a = [[rows[i][k] * weights[i] for k in used] for i in range(len(rows))]
        b = [targets[i] * weights[i] for i in range(len(rows))]
        values = _least_squares(a, b)
        if values is None or any(v <= 0 for v in values):
            continue
        x = [0.0, 0.0, 0.0]
        for k, v in zip(used, values):
            x[k] = v
        misfit = sum((sum(r[k] * x[k] for k in range(3)) * w - t * w) ** 2
                     for r, t, w in zip(rows, targets, weights))
        if best is None or misfit < best[0] - 1e-15:
            best = (misfit, x)
    if best is None:
        return Units(0.0, 0.0, 0.0)
    return Units(*best[1])


def _least_squares(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x minimising |a x - b| from the normal equations (at most three unknowns), or None
    where they are singular."""
    n = len(a[0])
    m = [[sum(r[i] * r[j] for r in a) for j in range(n)] + [sum(r[i] * y for r, y in zip(a, b))]
         for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        scale = max(abs(m[r][c]) for r in range(n) for c in range(n)) or 1.0
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]
