"""Settings as solver options, which hierarchies the layers allow, and the cheapest of them.

A `Setting` names cycles, levels and (where the controller moves between hierarchies) a
coarsening and the coarse levels' relaxation; `configs_of` turns it into the forward and
backward `Config`s, `valid` says whether its hierarchy can be built and its coarse steps are
judged stable, and `cheapest` ranks the valid hierarchies by the calibrated cost model
(`cost.step_seconds`): what `choose_settings` starts a network from.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from ...core.config import Config
from ...core.grid import build_hierarchy
from .cost import Calibration, step_seconds
from .policy import Setting

COARSENINGS = (2, 4, 8, 16)
RELAXATIONS = ("F", "FCF")


def _named(guess: object, kind: str) -> bool:
    """Whether an initial guess (a name or a tensor) is the named kind."""
    return isinstance(guess, str) and guess == kind


def starts_from_zero(config: Config) -> bool:
    """Whether `config` starts its solve from zero: the start a nested one may replace."""
    return _named(config.initial_guess, "zero")


def uniform(config: Config) -> tuple[int, str] | None:
    """(coarsening, relaxation below the fine level) of options that use one of each on
    every level, or None: only such hierarchies are changed by coarsening and relaxation
    moves (the user's per-level choices are kept)."""
    if config.levels < 2:
        return None
    factors = set(config.coarsening_list())
    coarse = {config.relax_at(level) for level in range(1, config.levels - 1)} or {"FCF"}
    if len(factors) != 1 or len(coarse) != 1:
        return None
    return factors.pop(), coarse.pop()


def configs_of(setting: Setting, forward: Config, backward: Config, base_levels: int,
               cold: bool = False) -> tuple[Config, Config]:
    """The forward and backward options of `setting`, from the user's `forward` and
    `backward` options (whose most levels are `base_levels`): `cold`, from a zero guess
    where the options would start warm. A pass keeps its own fewer levels unless the
    setting has more than the user's; a coarsening or coarse relaxation the setting names
    replaces the user's on every level; `nested` (`nested_backward`) starts the forward
    (backward) solve from the coarse levels' solution where it would start from zero."""
    out = []
    for pass_, (base, cycles) in enumerate(((forward, setting.forward),
                                            (backward, setting.backward))):
        if setting.steps_exactly(("forward", "backward")[pass_]):
            cfg = replace(base, levels=1, max_iter=1, tol=0.0, initial_guess="zero")
        else:
            levels = (min(setting.levels, base.levels) if setting.levels <= base_levels
                      else setting.levels)
            changes: dict = {"levels": levels, "max_iter": cycles}
            if setting.levels > base_levels or setting.coarsening or setting.coarse:
                coarse = setting.coarse or (base.relax_at(1) if base.levels > 2 else "FCF")
                changes.update(coarsening=setting.coarsening or base.coarsening_at(0),
                               relax=(base.relax_at(0),) + (coarse,) * (levels - 2)
                               if levels > 1 else "F")
            guess = base.initial_guess
            if setting.warm:
                guess = "warm"
            if cold and _named(guess, "warm"):
                guess = "zero"
            if (setting.nested, setting.nested_backward)[pass_] and _named(guess, "zero"):
                guess = "nested"
            # one replace: a Config of no cycles is valid only with its nested start
            cfg = replace(base, initial_guess=guess, **changes)
        out.append(cfg)
    return out[0], out[1]


def coarsest_stride(config: Config, num_steps: int) -> int:
    """Layers per step of the coarsest level: its forward-Euler step over the fine one's."""
    grids = build_hierarchy(num_steps, config.coarsening_list(), config.levels,
                            config.min_coarse)
    return grids[-1].stride


def valid(setting: Setting, forward: Config, backward: Config, base_levels: int,
          num_steps: int) -> bool:
    """Whether both passes of `setting` build the levels they name and their coarsest
    step is no longer than the user's options' (the longest step judged stable: a coarse
    forward-Euler step grows with the coarsening, and its stability is not measured), and
    a pass of no cycles starts nested."""
    if setting.exact:
        return True
    kinds = ("forward", "backward")
    for kind, cycles, nested, base in ((kinds[0], setting.forward, setting.nested, forward),
                                       (kinds[1], setting.backward, setting.nested_backward,
                                        backward)):
        # no cycle at all is a solve only from a nested start (`Config`)
        if (cycles == 0 and not setting.steps_exactly(kind)
                and (setting.warm or not (nested and starts_from_zero(base)))):
            return False
    longest = max(coarsest_stride(c, num_steps) for c in (forward, backward))
    for kind, cfg in zip(kinds, configs_of(setting, forward, backward, base_levels)):
        if setting.steps_exactly(kind):
            continue
        grids = build_hierarchy(num_steps, cfg.coarsening_list(), cfg.levels,
                                cfg.min_coarse)
        if len(grids) < cfg.levels or grids[-1].stride > longest:
            return False
    return True


def hierarchies(base: Setting, forward: Config, backward: Config, num_steps: int,
                most_levels: int, coarsenings: Iterable[int] = COARSENINGS,
                relaxations: Iterable[str] = RELAXATIONS) -> list[Setting]:
    """Every valid hierarchy at `base`'s cycles: 2 to `most_levels` levels, each
    coarsening and coarse relaxation (one relaxation where there is no coarse level
    between the fine and the coarsest)."""
    base_levels = max(forward.levels, backward.levels)
    out = []
    for levels in range(2, most_levels + 1):
        for m in coarsenings:
            for relax in (relaxations if levels > 2 else ("",)):
                s = replace(base, levels=levels, coarsening=m, coarse=relax)
                if valid(s, forward, backward, base_levels, num_steps):
                    out.append(s)
    return out


def cheapest(settings: Iterable[Setting], forward: Config, backward: Config,
             num_steps: int, ranks: int, calibration: Calibration
             ) -> list[tuple[float, Setting]]:
    """(modelled seconds of a training step's solves, setting), cheapest first; ties go
    to the earlier setting, so the order is the same wherever the numbers are."""
    base_levels = max(forward.levels, backward.levels)
    priced = [(step_seconds(*configs_of(s, forward, backward, base_levels), num_steps, ranks,
                            calibration), k, s) for k, s in enumerate(settings)]
    return [(cost, s) for cost, _, s in sorted(priced, key=lambda t: (t[0], t[1]))]
