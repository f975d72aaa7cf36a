"""The controller's decisions, from measured errors and modelled costs alone: when to probe,
which other settings to measure, which to train with (more cycles, fewer levels, exact
stepping when the error is too large; cheaper settings when it stays well below)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

# The defaults (docs/training.md, "Trusting the gradients", and docs/results.md give the
# measurements behind them, from `python -m benchmarks.controller`). A relative gradient
# error of 0.25 lies where training with inexact gradients stopped differing from exact
# training: the digits (W3) train with errors of 0.10-0.15 as well as serially; a 1024-layer
# network at T = 4 ended 12-13% above exact stepping's test loss with median errors of 0.77
# and 0.33, and 4% below it with 0.22.
THRESHOLD = 0.25
# steps between probes: at first, and at most once the error has stayed well within the
# threshold (the interval doubles at every such probe)
EVERY = 10
MAX_EVERY = 160
# most cycles of either pass
MAX_CYCLES = 4
# an error at most LOWER * threshold is well below it: cheaper settings may be tried; a
# setting is chosen only if its measured error is at most TARGET * threshold (a margin for
# the next batches, whose errors scatter around one batch's)
LOWER = 0.5
TARGET = 0.7
# a cheaper setting must save at least this share of the modelled cost to be worth a move
SAVING = 0.1
# a setting that does not meet the target is still a step towards one if it cuts the error by
# this factor at less cost than exact stepping
CUT = 1.5
# validation losses in a row that do not improve on the best before them by 1%: a plateau
PLATEAU = 3
# successive descent checks that found nothing cheaper wait twice as long, up to this many
# quiet probes (and failed trials of warm starts as many probes)
MOST_QUIET = 16
# warm starts are kept after a trial that cut the error by this factor: they cost nothing,
# but at the same cycles they raised the error of W1-W3 and of the deep case and halved
# W4's (docs/results.md), so they are tried, not assumed
WARM_GAIN = 1.25


@dataclass(frozen=True)
class Setting:
    """What the controller sets: cycles of the forward and backward solves and the levels
    of both (a pass whose own options have fewer keeps those, unless the setting has more
    levels than the user's); levels 1 is exact stepping, one sequential sweep each way.
    `warm`: both solves start from the previous step's states (otherwise from the guess of
    the user's options). `coarsening` (0: the user's) and `coarse`, the relaxation of the
    levels below the fine one ("F" or "FCF"; "": the user's), change the hierarchy.
    `nested`, `nested_backward`: the forward (backward) solve starts from the coarse
    levels' solution (`initial_guess="nested"`) where it would start from zero: one coarse
    march more, and 0 cycles allowed (the start F-relaxed once); `choose_settings` takes
    them where the measured error allows. `exact_pass`: "forward" or "backward", that pass
    steps exactly (levels 1, one sequential sweep, its cycles and start left aside) while
    the other runs the hierarchy; `choose_settings` prices such settings beside the others
    (on few ranks a sweep can cost less than a solve's fixed costs, and it has no error)."""

    forward: int
    backward: int
    levels: int
    warm: bool = False
    coarsening: int = 0
    coarse: str = ""
    nested: bool = False
    nested_backward: bool = False
    exact_pass: str = ""

    def __post_init__(self) -> None:
        if self.exact_pass not in ("", "forward", "backward"):
            raise ValueError(f"exact_pass must be '', 'forward' or 'backward', got "
                             f"{self.exact_pass!r}")

    @property
    def exact(self) -> bool:
        return self.levels == 1

    def steps_exactly(self, kind: str) -> bool:
        """Whether the pass `kind` ("forward" or "backward") steps exactly."""
        return self.exact or self.exact_pass == kind

    @property
    def label(self) -> str:
        if self.exact:
            return "exact"
        return (f"{self.forward}/{self.backward} L{self.levels}"
                + (f" m{self.coarsening}" if self.coarsening else "")
                + (f" {self.coarse}" if self.coarse else "") + (" warm" if self.warm else "")
                + (" nested" if self.nested else "")
                + (" nested-backward" if self.nested_backward else "")
                + (f" exact-{self.exact_pass}" if self.exact_pass else ""))

    def as_list(self) -> list[Any]:
        return [self.forward, self.backward, self.levels, self.warm, self.coarsening,
                self.coarse, self.nested, self.nested_backward, self.exact_pass]


EXACT_SETTING = Setting(1, 1, 1)


@dataclass(frozen=True)
class Moves:
    """The hierarchies a policy may move between besides cycles and levels below the
    user's: `levels` up to `most_levels`, the `coarsenings` and coarse relaxations
    (`relaxations`) named, cycles down to `least_cycles` (taken only where the measured
    error allows, like every move), `nested`: whether a cycle less from a nested start
    (down to none) is a move too, and `valid`, which says whether a setting's hierarchy
    can be built and its coarse steps are judged stable."""

    most_levels: int
    coarsenings: tuple[int, ...] = (2, 4, 8, 16)
    relaxations: tuple[str, ...] = ("F", "FCF")
    least_cycles: int = 1
    nested: bool = False
    valid: Callable[[Setting], bool] = field(default=lambda s: True, compare=False)


class Policy:
    """The controller's decisions, from measured errors and modelled costs alone: which step
    to probe, which other settings to measure after a probe, and which setting to train
    with next.

    base:       the user's setting: the fewest cycles and the most levels the policy uses.
    cost:       the modelled cost of a setting (`Controller.cost`); settings that cost more
                than exact stepping are never tried (exact stepping has no error).
    threshold:  the relative gradient error (training's against exact) to stay below.
    every, max_every: steps between probes (the first probe is at step 0).
    max_cycles: most cycles of either pass.
    moves:      other hierarchies to move between (`Moves`); without, the policy never goes
                below the base's cycles nor above its levels.

    After a probe has measured the error e of the current setting:
    - e > threshold: the settings one move more accurate (a cycle more in either pass, any
      number of levels fewer, exact stepping) are measured, and the cheapest that meets
      TARGET * threshold is taken; where only exact stepping meets it, the most accurate
      cheaper setting is taken instead if it cuts the error by CUT, and the search goes on
      at the next probe (`every` steps on);
    - e <= LOWER * threshold: after enough such probes in a row (one at first; twice as
      many after each check that found nothing, two after a climb) the settings that cost
      at least SAVING less (among the moves above and the ones back towards the base) are
      measured, and the cheapest within TARGET * threshold is taken;
    - otherwise the setting stays. The probe interval doubles (up to `max_every`) while
      e <= TARGET * threshold, stays above that, and is `every` again after a change.
    With `warm_trials`, a setting that stays with LOWER * threshold < e <= threshold is
    tried with warm starts (which cost nothing) until the next probe; they are kept if
    they cut the error by WARM_GAIN, otherwise dropped, and the next trial waits twice as
    many probes as the last. A move keeps the warm starts of the setting it leaves.
    While validation has stalled (`validation`) nothing cheaper is tried, and the next step
    is probed.
    """

    def __init__(self, base: Setting, cost: Callable[[Setting], float],
                 threshold: float = THRESHOLD, every: int = EVERY,
                 max_every: int = MAX_EVERY, max_cycles: int = MAX_CYCLES,
                 warm_trials: bool = True, moves: Moves | None = None) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or \
                not 0 < threshold < math.inf:
            raise ValueError(f"threshold must be a positive number, got {threshold!r}")
        for name, value, least in (("every", every, 1), ("max_every", max_every, every),
                                   ("max_cycles", max_cycles, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        self.base = base
        self.moves = moves
        self._cost = cost
        self._costs: dict[Setting, float] = {}
        self.threshold = float(threshold)
        self.every, self.max_every = every, max_every
        self.max_cycles = max(max_cycles, base.forward, base.backward)
        self.setting = base
        self.interval = every
        self.last_probe: int | None = None
        self.quiet = 0              # probes in a row with an error well below the threshold
        self.quiet_needed = 1       # ... before cheaper settings are measured
        self.calibration: float | None = None   # error / indicator at this setting's last probe
        self.came_from: Setting | None = None   # where exact stepping was reached from
        self.losses: list[float] = []           # validation losses, in order
        self.plateau = False
        self.probe_next = False
        self.warm_trials = warm_trials and not base.warm
        self.trial: float | None = None         # the error before warm starts were tried
        self.warm_wait = 0                      # probes before the next trial
        self.since_trial = 0

    def cost(self, setting: Setting) -> float:
        if setting not in self._costs:
            self._costs[setting] = self._cost(setting)
        return self._costs[setting]

    # what to measure ----------------------------------------------------------------------
    def due(self, step: int, estimate: float | None) -> bool:
        """Whether step `step` is probed: the first, then every `interval` steps, early
        (after at least `every` steps) when the cheap estimate exceeds the threshold, and
        the step after validation stalled."""
        if self.base.exact:
            return False
        if self.last_probe is None or self.probe_next:
            return True
        since = step - self.last_probe
        if since >= self.interval:
            return True
        return since >= self.every and estimate is not None and estimate > self.threshold

    def estimate(self, indicator: float) -> float | None:
        """The gradient error predicted from a step's cheap indicator (its relative
        residuals), scaled as at the setting's last probe; None before one."""
        if self.setting.exact:
            return 0.0
        if self.calibration is None:
            return None
        return self.calibration * indicator

    def _affordable(self, settings: list[Setting]) -> list[Setting]:
        """`settings` without the current one, repeats, and those that cost more than exact
        stepping (which has no error)."""
        ceiling = self.cost(EXACT_SETTING)
        out: list[Setting] = []
        for s in settings:
            if s != self.setting and s not in out and (s.exact or self.cost(s) < ceiling):
                out.append(s)
        return out

    def _valid(self, settings: list[Setting]) -> list[Setting]:
        moves = self.moves
        return [s for s in settings if s.exact or moves is None or moves.valid(s)]

    def more_accurate(self) -> list[Setting]:
        """A cycle more in either pass, any number of levels fewer (down to 2), exact
        stepping; with `moves` also FCF relaxation below the fine level and the next
        smaller coarsening."""
        s, moves = self.setting, self.moves
        if s.exact:
            return []
        out = []
        if s.backward < self.max_cycles:
            out.append(replace(s, backward=s.backward + 1))
        if s.forward < self.max_cycles:
            out.append(replace(s, forward=s.forward + 1))
        out += [replace(s, levels=levels) for levels in range(s.levels - 1, 1, -1)]
        if moves is not None:
            if s.coarse == "F" and "FCF" in moves.relaxations:
                out.append(replace(s, coarse="FCF"))
            smaller = [m for m in moves.coarsenings if 0 < m < s.coarsening]
            if s.coarsening and smaller:
                out.append(replace(s, coarsening=max(smaller)))
        return self._affordable(self._valid(out) + [EXACT_SETTING])

    def less_accurate(self) -> list[Setting]:
        """Back towards the base: a cycle less in either pass, a level more, the base (from
        exact stepping: the setting it was reached from, and the base). With `moves` the
        cycles may go below the base's and the levels above, and the next larger
        coarsening and F-relaxation below the fine level are cheaper moves too, and with
        `moves.nested` a cycle less from a nested start, down to none."""
        s, base, moves = self.setting, self.base, self.moves
        if s.exact:
            return self._affordable([self.came_from or base, base])
        least = (base.backward, base.forward) if moves is None else (moves.least_cycles,) * 2
        most_levels = base.levels if moves is None else moves.most_levels
        out = []
        if s.backward > least[0]:
            out.append(replace(s, backward=s.backward - 1))
        if s.forward > least[1]:
            out.append(replace(s, forward=s.forward - 1))
        if moves is not None and moves.nested:
            # a cycle less from a nested start, down to none (`hierarchy.valid` keeps the
            # passes whose options start from zero)
            if s.backward > 0:
                out.append(replace(s, backward=s.backward - 1, nested_backward=True))
            if s.forward > 0:
                out.append(replace(s, forward=s.forward - 1, nested=True))
        if s.levels < most_levels:
            out.append(replace(s, levels=s.levels + 1))
        if moves is not None:
            larger = [m for m in moves.coarsenings if m > s.coarsening > 0]
            if larger:
                out.append(replace(s, coarsening=min(larger)))
            if s.coarse == "FCF" and "F" in moves.relaxations:
                out.append(replace(s, coarse="F"))
        return self._affordable(self._valid(out) + [replace(base, warm=s.warm)])

    def wanted(self, error: float) -> list[Setting]:
        """The settings to measure after a probe found `error` at the current one."""
        if error > self.threshold:
            return self.more_accurate()
        if error <= LOWER * self.threshold and not self.plateau and \
                self.quiet + 1 >= self.quiet_needed:
            limit = (1 - SAVING) * self.cost(self.setting)
            return [s for s in self._affordable(self.less_accurate() + self.more_accurate())
                    if self.cost(s) < limit]
        return []

    # deciding ----------------------------------------------------------------------------
    def decide(self, step: int, error: float, candidates: dict[Setting, float],
               indicator: float | None = None) -> tuple[Setting, str]:
        """The setting for the next steps and why, after the probe at `step` measured
        `error` at the current setting and the errors of the `candidates` it was asked for
        (`wanted`); `indicator` is the probed step's cheap indicator (`estimate`)."""
        current = self.setting
        self.last_probe = step
        self.probe_next = False
        verdict = None              # of a trial of warm starts since the last probe
        if self.trial is not None:
            verdict = error <= self.trial / WARM_GAIN and error <= self.threshold
            self.trial = None
        self.since_trial += 1
        new, why = current, "within threshold"
        if error > self.threshold:
            new = self._climb(error, candidates)
            why = "error above threshold"
            self.quiet = 0
        elif error <= LOWER * self.threshold and not self.plateau:
            self.quiet += 1
            why = "well below threshold"
            if candidates:
                new = self._descend(candidates)
                if new == current:
                    self.quiet_needed = min(2 * self.quiet_needed, MOST_QUIET)
                    self.quiet = 0
                    why = "nothing cheaper within threshold"
                else:
                    why = "cheaper within threshold"
        else:
            self.quiet = 0
        if verdict is False:
            new = replace(new, warm=False)
            self.warm_wait = min(max(2 * self.warm_wait, 2), MOST_QUIET)
            self.since_trial = 0
            if new == replace(current, warm=False):
                why = "warm starts did not help"
        elif verdict and new == current:
            why = "warm starts helped"
        elif (self.warm_trials and new == current and not current.exact
              and not current.warm and LOWER * self.threshold < error <= self.threshold
              and self.since_trial > self.warm_wait
              and self._valid([replace(current, warm=True)])):
            self.trial = error
            new, why = replace(current, warm=True), "trying warm starts"
        if new != current:
            if new.exact:
                self.came_from = current
            if error > self.threshold:
                # down again only after two quiet probes: one batch's low error after a
                # climb is weaker evidence than the high one that caused it
                self.quiet_needed = max(self.quiet_needed, 2)
            self.setting = new
            self.interval = self.every
            self.calibration = None
            self.quiet = 0
        else:
            if error <= TARGET * self.threshold:
                self.interval = min(2 * self.interval, self.max_every)
            if indicator is not None and indicator > 0:
                self.calibration = error / indicator
        return new, why

    def _climb(self, error: float, candidates: dict[Setting, float]) -> Setting:
        meeting = [s for s, e in candidates.items() if e <= TARGET * self.threshold]
        if meeting:
            best = min(meeting, key=self.cost)
            if not best.exact:
                return best
        steps = [s for s, e in candidates.items() if not s.exact and e <= error / CUT]
        if steps:
            return min(steps, key=lambda s: (candidates[s], self.cost(s)))
        if EXACT_SETTING in candidates or not candidates:
            return EXACT_SETTING
        return min(candidates, key=lambda s: candidates[s])

    def _descend(self, candidates: dict[Setting, float]) -> Setting:
        limit = (1 - SAVING) * self.cost(self.setting)
        cheaper = [s for s, e in candidates.items()
                   if e <= TARGET * self.threshold and self.cost(s) < limit]
        return min(cheaper, key=self.cost) if cheaper else self.setting

    # the loss trend ----------------------------------------------------------------------
    def validation(self, loss: float) -> bool:
        """Record a validation loss; returns whether validation has stalled: none of the
        latest PLATEAU losses improved on the best before them by 1%. A stall has the next
        step probed and holds off cheaper settings until the loss improves again."""
        self.losses.append(float(loss))
        earlier, latest = self.losses[:-PLATEAU], self.losses[-PLATEAU:]
        stalled = (len(earlier) > 0 and len(latest) == PLATEAU
                   and min(latest) > 0.99 * min(earlier))
        if stalled and not self.plateau:
            self.probe_next = True
        self.plateau = stalled
        return stalled

    # checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"setting": self.setting.as_list(), "interval": self.interval,
                "last_probe": self.last_probe, "quiet": self.quiet,
                "quiet_needed": self.quiet_needed, "calibration": self.calibration,
                "came_from": self.came_from.as_list() if self.came_from else None,
                "losses": list(self.losses), "plateau": self.plateau,
                "probe_next": self.probe_next, "trial": self.trial,
                "warm_wait": self.warm_wait, "since_trial": self.since_trial}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.setting = Setting(*state["setting"])
        self.interval = state["interval"]
        self.last_probe = state["last_probe"]
        self.quiet, self.quiet_needed = state["quiet"], state["quiet_needed"]
        self.calibration = state["calibration"]
        self.came_from = Setting(*state["came_from"]) if state["came_from"] else None
        self.losses = list(state["losses"])
        self.plateau, self.probe_next = state["plateau"], state["probe_next"]
        self.trial, self.warm_wait = state["trial"], state["warm_wait"]
        self.since_trial = state["since_trial"]
