"""Measuring what a network's solves cost, so that the cost model prices settings by this
machine and these layers rather than by a fixed batching gain.

`calibrate` times the forward and adjoint solves of a few hierarchies on the network's own
layers and state (exact stepping pins a march step's cost, two-level and three-level
solves with different coarsenings the cost of a batched call and of each interval in it),
averages the seconds over the ranks so that every rank fits the same numbers, and fits the
cost model's `Units` to them (`cost.fit`). `choose.choose_settings` prices hierarchies
with the result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from torch import Tensor

from ...core.config import Config
from ...core.grid import build_hierarchy
from ..layer_parallel import LayerParallel
from .agreement import mean_over_ranks
from .cost import LATENCY, Calibration, Terms, fit, solve_terms
from .probe import probe_solves

# the hierarchies timed besides exact stepping: (levels, coarsening), one cycle each way
TIMED = ((2, 2), (2, 8), (3, 4))
REPEATS = 3


def closure_of(model: LayerParallel, like: Tensor | Callable[[], Tensor]) -> Callable[[], Tensor]:
    if callable(like):
        return like
    if not isinstance(like, Tensor):
        raise TypeError(f"like must be an input batch (a tensor) or a closure returning a "
                        f"loss, got {type(like).__name__}")
    # any scalar of the output times the solves alike: its cotangent is not all zeros
    return lambda: model(like).float().square().mean()


def timed_configs(model: LayerParallel) -> list[tuple[Config, Config]]:
    """Exact stepping and the `TIMED` hierarchies that the model's layers allow."""
    forward, backward = model.forward_config, model.backward_config
    out = [(replace(c, levels=1, max_iter=1, tol=0.0, initial_guess="zero")
            for c in (forward, backward))]
    for levels, m in TIMED:
        pair = tuple(replace(c, levels=levels, coarsening=m, max_iter=1, tol=0.0,
                             initial_guess="zero", min_coarse=1,
                             relax=("F",) + ("FCF",) * (levels - 2))
                     for c in (forward, backward))
        if len(build_hierarchy(model.num_steps, (m,) * (levels - 1), levels, 1)) == levels:
            out.append(pair)
    return [tuple(p) for p in out]


def calibrate(model: LayerParallel, like: Tensor | Callable[[], Tensor],
              repeats: int = REPEATS, latency: float = LATENCY) -> Calibration:
    """The cost model's units for `model` on this machine: the forward and adjoint solves
    of exact stepping and of a few hierarchies timed on `like` (an input batch, or a
    closure computing a loss through the model, as `Controller.after_backward` is given),
    the fastest of `repeats` runs each after one untimed, averaged over the ranks and
    fitted (`cost.fit`). `latency`: seconds a hop adds to the path. The parameters'
    gradients and training's solvers are as they were afterwards (`probe`). Collective:
    every rank gets the same numbers."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not latency >= 0:
        raise ValueError(f"latency must be a number >= 0 (seconds), got {latency!r}")
    closure = closure_of(model, like)
    pairs = timed_configs(model)
    seconds: list[float] = []
    for forward, backward in pairs:
        best = [float("inf"), float("inf")]
        for k in range(repeats + 1):
            _, _, stats = probe_solves(model, closure, forward, backward)
            if k > 0:       # the first builds and records what later runs reuse
                for i, kind in enumerate(("forward", "backward")):
                    best[i] = min(best[i], stats[kind]["seconds"])
        seconds += best
    seconds = mean_over_ranks(model, seconds)
    n, ranks = model.num_steps, model.comm.size
    samples: dict[str, list[tuple[Terms, float]]] = {"forward": [], "backward": []}
    for k, pair in enumerate(pairs):
        for i, kind in enumerate(("forward", "backward")):
            samples[kind].append((solve_terms(pair[i], n, ranks), seconds[2 * k + i]))
    return Calibration(fit(samples["forward"], latency), fit(samples["backward"], latency),
                       float(latency))
