"""Choosing a network's settings before training: the cheapest hierarchy by the calibrated
cost model (`cost.step_seconds`), and, given an error threshold, the fastest of the
settings whose gradient is measured to stay within it.

Without a threshold only hierarchies at the cycles of the model's options are priced: the
hierarchy changes what a cycle costs, and how far a cycle converges is not measured. With
one, fewer cycles and nested starts are priced as well (the coarse levels' solution as the
first guess: on the reference workloads one forward cycle from there is about as accurate
as two from zero, and no cycle, the start F-relaxed once, as one from zero), and so are
settings that step one pass exactly; the cheapest candidates by price are measured against
exact stepping's gradient on the given batch, and those that meet the threshold are timed
beside exact stepping itself: the model prices what a solve's phases do, not its fixed
costs, which on few ranks can make a sequential sweep the faster pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from torch import Tensor

from ...core.config import Config
from ..layer_parallel import LayerParallel
from .agreement import gradient_agreement, mean_over_ranks
from .calibrate import REPEATS, calibrate, closure_of
from .cost import Calibration
from .hierarchy import cheapest, configs_of, hierarchies, starts_from_zero
from .policy import EXACT_SETTING, TARGET, Setting
from .probe import EXACT, probe_solves

# candidates measured at most, cheapest first, before exact stepping is taken
TRIALS = 8

# timed settings within this fraction of the fastest count as fast as it: the first of them
# is taken (exact stepping, which has no error, then the cheapest by price), so that the
# timing's noise on a shared machine does not trade exactness for nothing
MARGIN = 0.05


def _check(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return value


def _passes(cycles: int, zero: bool) -> list[tuple[int, bool]]:
    """(cycles, nested start) of one pass: `cycles` down to 1 from the options' start, and
    where that is zero also from a nested one, down to none."""
    out = [(k, False) for k in range(cycles, 0, -1)]
    if zero:
        out += [(k, True) for k in range(cycles, -1, -1)]
    return out


def candidates(base: Setting, forward: Config, backward: Config, num_steps: int,
               most_levels: int, fewer_cycles: bool, exact_passes: bool = False
               ) -> list[Setting]:
    """Every valid hierarchy at `base`'s cycles (`hierarchies`) and, with `fewer_cycles`,
    at every smaller number of cycles of either pass, and from a nested start where the
    pass's options start from zero (then down to no cycle: the start F-relaxed once); and
    with `exact_passes` too, each of those with one pass stepped exactly (`exact_pass`)."""
    if not fewer_cycles:
        return hierarchies(base, forward, backward, num_steps, most_levels)
    out = []
    forwards = _passes(base.forward, starts_from_zero(forward))
    backwards = _passes(base.backward, starts_from_zero(backward))
    for f, nested in forwards:
        for b, nested_backward in backwards:
            at = replace(base, forward=f, backward=b, nested=nested,
                         nested_backward=nested_backward)
            out += hierarchies(at, forward, backward, num_steps, most_levels)
    if not exact_passes:
        return out
    # the exact pass's own cycles and start are left aside (one sweep): one setting each
    for b, nested_backward in backwards:
        at = replace(base, forward=1, backward=b, nested_backward=nested_backward,
                     exact_pass="forward")
        out += hierarchies(at, forward, backward, num_steps, most_levels)
    for f, nested in forwards:
        at = replace(base, forward=f, backward=1, nested=nested, exact_pass="backward")
        out += hierarchies(at, forward, backward, num_steps, most_levels)
    return out


def choose_settings(model: LayerParallel, like: Tensor | Callable[[], Tensor],
                    ranks: int | None = None, calibration: Calibration | None = None,
                    most_levels: int | None = None, repeats: int = REPEATS,
                    threshold: float | None = None, trials: int = TRIALS,
                    exact_passes: bool = True) -> tuple[Config, Config]:
    """The forward and backward options of the hierarchy the calibrated cost model prices
    cheapest for `model` on `ranks` ranks (by default its own): 2 to `most_levels` levels
    (by default one more than its options have), coarsenings 2, 4, 8 and 16 and F or FCF
    relaxation below the fine level, where the layers allow them and the coarsest step is
    no longer than the current options' (`hierarchy.valid`). `calibration` is measured on
    `like` (an input batch, or a closure computing a loss through the model; `calibrate`)
    unless given.

    Without `threshold`: at the cycles of the model's current options, and exact stepping
    is not among the choices (compare `cost.step_seconds` of levels=1).

    With `threshold` (a relative gradient error, as `Controller` takes): fewer cycles of
    either pass and nested starts (down to no cycle: the start F-relaxed once) are
    candidates too, and with `exact_passes` so is each setting with one pass stepped
    exactly (on few ranks a sequential sweep can cost less than a solve's fixed costs); the
    `trials` cheapest (and where they are timed, the cheapest with either pass exact as
    well) are measured in order of price (`probe_solves` on `like`, against exact
    stepping's gradient); those whose error is at most TARGET * threshold (the margin the
    controller keeps for other batches), and with `exact_passes` exact stepping itself
    (levels=1, which has no error), are timed (`repeats` probes each, taking turns, the
    fastest, averaged over the ranks) and the fastest is returned (of those within MARGIN
    of the fastest, exact stepping, else the cheapest by price); exact stepping where none
    meets it. Where
    `ranks` is not the model's own, nothing can be timed: the cheapest by price that meets
    the threshold is returned. `exact_passes=False` keeps every pass a hierarchy where one
    meets the threshold (what MGRIT itself costs). The parameters' gradients and
    training's solvers are as they were afterwards.

    Collective unless `calibration` is given and `threshold` is None: every rank gets the
    same options."""
    if not isinstance(model, LayerParallel):
        raise TypeError(f"model must be a mgrit.LayerParallel, got {type(model).__name__}")
    forward, backward = model.forward_config, model.backward_config
    levels = max(forward.levels, backward.levels)
    most = _check("most_levels", most_levels if most_levels is not None else levels + 1, 2)
    ranks = _check("ranks", model.comm.size if ranks is None else ranks, 1)
    if threshold is not None and (isinstance(threshold, bool)
                                  or not isinstance(threshold, (int, float))
                                  or not threshold > 0):
        raise ValueError(f"threshold must be a number > 0 (a relative gradient error), got "
                         f"{threshold!r}")
    _check("trials", trials, 1)
    closure = closure_of(model, like)
    if calibration is None:
        calibration = calibrate(model, closure, repeats)
    base = Setting(forward.max_iter, backward.max_iter, levels)
    options = candidates(base, forward, backward, model.num_steps, most,
                         fewer_cycles=threshold is not None,
                         exact_passes=threshold is not None and exact_passes)
    if not options:
        return forward, backward
    ranked = [s for _, s in cheapest(options, forward, backward, model.num_steps, ranks,
                                     calibration)]
    if threshold is None:
        return configs_of(ranked[0], forward, backward, levels)
    exact_configs = configs_of(EXACT_SETTING, forward, backward, levels)
    exact, _, _ = probe_solves(model, closure, EXACT, EXACT)
    timed = ranks == model.comm.size
    met = [exact_configs] if timed and exact_passes else []
    for setting in _trials(ranked, trials, timed):
        configs = configs_of(setting, forward, backward, levels, cold=True)
        gradients, _, _ = probe_solves(model, closure, *configs)
        error = gradient_agreement(model, gradients, exact)["overall"]["relative_error"]
        if error <= TARGET * threshold:
            met.append(configs)
            if not timed:
                break
    if not met:
        return exact_configs
    if not timed:
        return met[0]
    # the model leaves out a solve's fixed costs (its set-up, residual, reduction), which on
    # few ranks decide between a hierarchy and a sequential sweep: the settings that meet
    # the threshold, exact stepping first, are timed on the model's own ranks
    seconds = mean_over_ranks(model, _solve_seconds(model, closure, met, repeats))
    fast = min(seconds) * (1.0 + MARGIN)
    return next(configs for configs, s in zip(met, seconds) if s <= fast)


def _trials(ranked: list[Setting], trials: int, timed: bool) -> list[Setting]:
    """The settings measured, in order of price: the `trials` cheapest and, where they are
    timed, the cheapest with each pass stepped exactly too. The model leaves out the fixed
    costs that an exact pass saves, so it can rank such settings below the trials on just
    the ranks where they are the fastest."""
    out = ranked[:trials]
    if timed:
        for kind in ("forward", "backward"):
            if not any(s.exact_pass == kind for s in out):
                out += [s for s in ranked[trials:] if s.exact_pass == kind][:1]
    return out


def _solve_seconds(model: LayerParallel, closure: Callable[[], Tensor],
                   settings: list[tuple[Config, Config]], repeats: int) -> list[float]:
    """The seconds of a training step's two solves with each of `settings` on this rank:
    each pass's fastest of `repeats` probes. The settings take turns, `repeats` rounds of
    one probe each, so that a slow spell of a shared machine falls on all of them rather
    than on the one timed then; each timed probe follows an untimed one of its own
    settings, which builds the solvers after a change of options and leaves the caches as
    that setting uses them."""
    best = [[float("inf"), float("inf")] for _ in settings]
    for _ in range(repeats):
        for k, configs in enumerate(settings):
            probe_solves(model, closure, *configs)
            _, _, stats = probe_solves(model, closure, *configs)
            for i, kind in enumerate(("forward", "backward")):
                best[k][i] = min(best[k][i], stats[kind]["seconds"])
    return [sum(pair) for pair in best]
