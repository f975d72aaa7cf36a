"""How far to trust the gradients of inexact MGRIT, and keeping them trustworthy.

Training solves each pass with a few MGRIT cycles, so its gradients are not the network's
exact gradients. This module measures by how much and acts on it:

- `gradient_agreement`: cosine similarity and relative error of one gradient against
  another, per parameter group (opening, layers, closing) and overall, from sums over the
  ranks, so that every rank gets the same numbers;
- `probe`: the gradient of the training step just taken computed again with other solver
  options (by default exact stepping, `levels=1`: one sequential sweep each way), without
  disturbing the step: the parameters' gradients are the training step's again afterwards;
- `solve_cost`: a model of what a solve costs on the critical path, so that settings are
  priced alike on every rank and in every rerun;
- `Policy`: the decisions alone, from measured errors and modelled costs: when to probe,
  which other settings to measure, which to train with (more cycles, fewer levels, exact
  stepping when the error is too large; cheaper settings when it stays well below);
- `Controller`: probes every few steps, lets the policy decide and changes the solvers of
  the model (`LayerParallel.set_solvers`) to keep the measured error below a threshold at
  the least cost.

Every decision follows from numbers that are the same on every rank (sums reduced over the
layer-parallel group, or the caller's values averaged over it), so all ranks decide alike.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from ..core.config import Config
from ..core.cycle import DivergenceError
from ..core.grid import build_hierarchy
from .layer_parallel import LayerParallel

GROUPS = ("opening", "layers", "closing")
# options of an exact pass: sequential stepping, one sweep (levels=1 ignores the rest)
EXACT = Config(levels=1, max_iter=1, tol=0.0)


# measuring ---------------------------------------------------------------------------------

def _group(name: str) -> str:
    """The parameter group of a `LayerParallel` parameter name."""
    head = name.split(".", 1)[0]
    return head if head in GROUPS else "layers"


def gradient_agreement(model: LayerParallel, gradients: Sequence[Tensor | None],
                       reference: Sequence[Tensor | None]) -> dict[str, dict[str, float]]:
    """Cosine similarity and relative error |g - r| / |r| of `gradients` against
    `reference` (one entry per trainable parameter of `model`, in `parameters()` order; None
    counts as zero), per group ("opening", "layers", "closing") and "overall".

    Each rank holds its own layers' gradients and the same opening and closing ones, so the
    sums of products are reduced over the layer-parallel group once, with the replicated
    groups counted on one rank only: every rank gets the same numbers. Collective."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    if len(names) != len(gradients) or len(names) != len(reference):
        raise ValueError(f"{len(gradients)} gradients and {len(reference)} references for "
                         f"{len(names)} trainable parameters")
    # per group: <g, r>, |g|^2, |r|^2, |g - r|^2 (the difference directly: accurate for
    # small errors, where the expanded form would cancel)
    sums = torch.zeros(len(GROUPS), 4, dtype=torch.float64)
    for name, g, r in zip(names, gradients, reference):
        row = GROUPS.index(_group(name))
        if row != GROUPS.index("layers") and model.comm.rank != 0:
            continue
        if g is None and r is None:
            continue
        g = torch.zeros_like(r) if g is None else g
        r = torch.zeros_like(g) if r is None else r
        g64, r64 = g.detach().double().reshape(-1), r.detach().double().reshape(-1)
        d = g64 - r64
        sums[row] += torch.stack([g64 @ r64, g64 @ g64, r64 @ r64, d @ d]).cpu()
    if model.comm.size > 1:
        model.comm.allreduce_sum_(sums)
    out = {group: _agreement(*sums[i].tolist()) for i, group in enumerate(GROUPS)}
    out["overall"] = _agreement(*sums.sum(dim=0).tolist())
    return out


def _agreement(dot: float, gg: float, rr: float, dd: float) -> dict[str, float]:
    cosine = dot / math.sqrt(gg * rr) if gg > 0 and rr > 0 else (1.0 if gg == rr else 0.0)
    error = math.sqrt(dd / rr) if rr > 0 else (0.0 if dd == 0 else math.inf)
    return {"cosine": cosine, "relative_error": error}


@dataclass
class ProbeResult:
    """What one probe measured: the agreement of the training step's gradient with the
    probe's (per group and overall, `gradient_agreement`), the probe's loss, the seconds
    its two solves took on this rank (`stats` "seconds": what the solver options cost) and
    the seconds the whole probe took."""

    agreement: dict[str, dict[str, float]]
    loss: float
    solve_seconds: float
    seconds: float
    gradients: list[Tensor | None] = field(default_factory=list, repr=False)

    @property
    def error(self) -> float:
        """The overall relative error of the training gradient against the probe's."""
        return self.agreement["overall"]["relative_error"]

    @property
    def cosine(self) -> float:
        return self.agreement["overall"]["cosine"]


def probe_gradients(model: LayerParallel, closure: Callable[[], Tensor], forward: Config,
                    backward: Config) -> tuple[list[Tensor | None], float, float]:
    """(gradients, loss, seconds of its two solves on this rank) of the training step just
    taken, computed again with the solver options `forward` and `backward`; the parameters'
    own gradients are as they were afterwards. See `probe`."""
    params = [p for p in model.parameters() if p.requires_grad]
    trained = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        with model.probing(forward, backward) as stats:
            loss = closure()
            loss.backward()
        gradients = [p.grad for p in params]
    finally:
        for p, g in zip(params, trained):
            p.grad = g
    seconds = sum(stats[kind]["seconds"] for kind in ("forward", "backward") if kind in stats)
    return gradients, float(loss.detach()), seconds


def probe(model: LayerParallel, closure: Callable[[], Tensor], forward: Config = EXACT,
          backward: Config = EXACT) -> ProbeResult:
    """The gradient of the training step just taken, computed again with the solver options
    `forward` and `backward` (by default exact stepping), and compared with the training
    gradient that the parameters hold. `closure()` computes the step's loss again: the same
    batch through `model` (`loss_fn(model(x), y)`). Call it after the step's backward pass
    and before the optimizer step: the parameters' gradients are the training step's again
    when it returns (the optimizer steps with the gradient training produced), the random
    draws are the step's own, and training's solvers and warm-start states are untouched
    (`LayerParallel.probing`). Collective."""
    start = time.perf_counter()
    trained = [p.grad for p in model.parameters() if p.requires_grad]
    gradients, loss, solve_seconds = probe_gradients(model, closure, forward, backward)
    agreement = gradient_agreement(model, trained, gradients)
    return ProbeResult(agreement, loss, solve_seconds, time.perf_counter() - start, gradients)


# what settings cost ----------------------------------------------------------------------------

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


# deciding ------------------------------------------------------------------------------------

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
    of both (a pass whose own options have fewer keeps those); levels 1 is exact stepping,
    one sequential sweep each way. `warm`: both solves start from the previous step's
    states (otherwise from the guess of the user's options)."""

    forward: int
    backward: int
    levels: int
    warm: bool = False

    @property
    def exact(self) -> bool:
        return self.levels == 1

    @property
    def label(self) -> str:
        if self.exact:
            return "exact"
        return f"{self.forward}/{self.backward} L{self.levels}" + (" warm" if self.warm else "")

    def as_list(self) -> list[Any]:
        return [self.forward, self.backward, self.levels, self.warm]


EXACT_SETTING = Setting(1, 1, 1)


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
                 warm_trials: bool = True) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or \
                not 0 < threshold < math.inf:
            raise ValueError(f"threshold must be a positive number, got {threshold!r}")
        for name, value, least in (("every", every, 1), ("max_every", max_every, every),
                                   ("max_cycles", max_cycles, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        self.base = base
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

    def more_accurate(self) -> list[Setting]:
        """A cycle more in either pass, any number of levels fewer (down to 2), exact
        stepping."""
        s = self.setting
        if s.exact:
            return []
        out = []
        if s.backward < self.max_cycles:
            out.append(replace(s, backward=s.backward + 1))
        if s.forward < self.max_cycles:
            out.append(replace(s, forward=s.forward + 1))
        out += [replace(s, levels=levels) for levels in range(s.levels - 1, 1, -1)]
        return self._affordable(out + [EXACT_SETTING])

    def less_accurate(self) -> list[Setting]:
        """Back towards the base: a cycle less in either pass, a level more, the base (from
        exact stepping: the setting it was reached from, and the base)."""
        s, base = self.setting, self.base
        if s.exact:
            return self._affordable([self.came_from or base, base])
        out = []
        if s.backward > base.backward:
            out.append(replace(s, backward=s.backward - 1))
        if s.forward > base.forward:
            out.append(replace(s, forward=s.forward - 1))
        if s.levels < base.levels:
            out.append(replace(s, levels=s.levels + 1))
        return self._affordable(out + [replace(base, warm=s.warm)])

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
              and self.since_trial > self.warm_wait):
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


# the controller --------------------------------------------------------------------------------

def _relative_residual(stats: dict[str, Any]) -> float:
    """The last residual of a solve relative to the norm of its given state."""
    residuals, norm = stats.get("residuals") or [0.0], stats.get("initial_norm", 0.0)
    return residuals[-1] / norm if norm > 0 else 0.0


class Controller:
    """Keeps the gradients of layer-parallel training within `threshold` (relative error
    against the exact gradient) at the least cost, by probing and changing the solvers
    between steps (`Policy` decides; `LayerParallel.set_solvers` applies).

    Use it between a training step's backward pass and its optimizer step::

        controller = mgrit.Controller(model)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            controller.after_backward(lambda: loss_fn(model(x), y))
            optimizer.step()
        ...
        controller.validation(test_loss)          # after each evaluation, on every rank

    Every step it records the step's cheap indicator (the last residual of each solve
    relative to the norm of its given state) and, scaled by the last probe, an estimate of
    the gradient error. Probed steps (the first, then every `every` to `max_every` steps,
    earlier when the estimate exceeds the threshold) compute the exact gradient of the same
    batch (`probe`: one sequential sweep each way, the step's own random draws) and its
    agreement with the training gradient, per group and overall; where the policy asks,
    other settings are measured against it too (cold: from a zero guess). The optimizer
    then steps with the training gradient, untouched.

    Settings are priced by `solve_cost` (`batching`: see `BATCHING`) for the layer-parallel
    ranks: a model, not a stopwatch, so that a run decides the same way every time it is
    run (resumed, traced, on another machine). Errors are sums reduced over the ranks (and
    the same on data-parallel replicas, whose gradients are averaged), validation losses
    are averaged over them: every rank decides alike. Every rank calls `after_backward` and
    `validation` (collective).

    `after_backward` returns the step's record (also in `model.stats["control"]` and
    `last`); `probes` and `decisions` keep the probed steps' and the changes' records.
    """

    def __init__(self, model: LayerParallel, threshold: float = THRESHOLD,
                 every: int = EVERY, max_every: int = MAX_EVERY,
                 max_cycles: int = MAX_CYCLES, batching: float = BATCHING,
                 warm_trials: bool = True, policy: Policy | None = None) -> None:
        if not isinstance(model, LayerParallel):
            raise TypeError(f"model must be a mgrit.LayerParallel, got {type(model).__name__}")
        if isinstance(batching, bool) or not isinstance(batching, (int, float)) or \
                not 0 < batching < math.inf:
            raise ValueError(f"batching must be a positive number, got {batching!r}")
        self.model = model
        self.batching = float(batching)
        self.forward_config, self.backward_config = model.forward_config, model.backward_config
        self.base = Setting(self.forward_config.max_iter, self.backward_config.max_iter,
                            max(self.forward_config.levels, self.backward_config.levels),
                            all(c.initial_guess == "warm"
                                for c in (self.forward_config, self.backward_config)))
        # a policy of one's own (another rule, or a test's) decides from the same numbers
        self.policy = policy if policy is not None else Policy(
            self.base, self.cost, threshold, every, max_every, max_cycles, warm_trials)
        self.step = 0
        self.last: dict[str, Any] = {}
        self.probes: list[dict[str, Any]] = []
        self.decisions: list[dict[str, Any]] = []

    @property
    def setting(self) -> Setting:
        return self.policy.setting

    def configs(self, setting: Setting, cold: bool = False) -> tuple[Config, Config]:
        """The forward and backward options of `setting` (`cold`: from a zero guess where
        the options would start warm)."""
        out = []
        for base, cycles in ((self.forward_config, setting.forward),
                             (self.backward_config, setting.backward)):
            if setting.exact:
                cfg = replace(base, levels=1, max_iter=1, tol=0.0, initial_guess="zero")
            else:
                cfg = replace(base, levels=min(setting.levels, base.levels), max_iter=cycles)
                if setting.warm:
                    cfg = replace(cfg, initial_guess="warm")
                if cold and cfg.initial_guess == "warm":
                    cfg = replace(cfg, initial_guess="zero")
            out.append(cfg)
        return out[0], out[1]

    def cost(self, setting: Setting) -> float:
        """The modelled cost of a training step's two solves with `setting` on this model's
        layer-parallel ranks (`solve_cost`; an adjoint step counts twice a forward step)."""
        forward, backward = self.configs(setting)
        n, ranks = self.model.num_steps, self.model.comm.size
        return (solve_cost(forward, n, ranks, self.batching)
                + 2 * solve_cost(backward, n, ranks, self.batching))

    def _reduced(self, values: list[float]) -> list[float]:
        """The mean over the layer-parallel ranks and the data-parallel replicas."""
        model = self.model
        buf = torch.tensor(values, dtype=torch.float64)
        count = 1
        for comm in (model.comm, model.data_comm):
            if comm is not None and comm.size > 1:
                comm.allreduce_sum_(buf)
                count *= comm.size
        return (buf / count).tolist()

    def after_backward(self, closure: Callable[[], Tensor]) -> dict[str, Any]:
        """Record the step whose backward pass just ended and, where one is due, probe it
        and decide; `closure()` computes the step's loss again (the same batch through the
        model). Returns the step's record. Collective."""
        model, policy = self.model, self.policy
        stats = model.stats
        indicator = sum(_relative_residual(stats[k]) for k in ("forward", "backward")
                        if k in stats)
        if model.comm.size > 1 or model.data_comm is not None:
            # the norms are of replicated tensors, the same on every rank in principle; a
            # decision must not rest on that
            indicator = self._reduced([indicator])[0]
        estimate = policy.estimate(indicator)
        setting = policy.setting
        record: dict[str, Any] = {"step": self.step, "setting": setting.label,
                                  "forward_cycles": setting.forward,
                                  "backward_cycles": setting.backward,
                                  "levels": setting.levels, "estimate": estimate}
        if policy.due(self.step, estimate):
            record["probe"] = self._probe(closure, indicator)
        self.step += 1
        self.last = record
        model.stats["control"] = record
        return record

    def _probe(self, closure: Callable[[], Tensor], indicator: float) -> dict[str, Any]:
        model, policy = self.model, self.policy
        start = time.perf_counter()
        current = policy.setting
        trained = [p.grad for p in model.parameters() if p.requires_grad]
        if current.exact:
            # the training gradient is the exact one
            reference = trained
            agreement = gradient_agreement(model, trained, trained)
        else:
            reference, _, _ = probe_gradients(model, closure, *self.configs(EXACT_SETTING))
            agreement = gradient_agreement(model, trained, reference)
        error = agreement["overall"]["relative_error"]
        candidates: dict[Setting, float] = {}
        for setting in policy.wanted(error):
            if setting.exact:
                candidates[setting] = 0.0
                continue
            try:
                gradients, _, _ = probe_gradients(model, closure,
                                                  *self.configs(setting, cold=True))
            except DivergenceError:
                # raised on every rank alike: a setting that diverges is no candidate
                candidates[setting] = math.inf
                continue
            candidates[setting] = gradient_agreement(
                model, gradients, reference)["overall"]["relative_error"]
        new, why = policy.decide(self.step, error, candidates, indicator)
        if new != current:
            model.set_solvers(*self.configs(new))
        out: dict[str, Any] = {
            "error": error, "cosine": agreement["overall"]["cosine"],
            "groups": {g: agreement[g] for g in GROUPS},
            "candidates": {s.label: e for s, e in candidates.items()},
            "seconds": time.perf_counter() - start}
        self.probes.append({"step": self.step, "setting": current.label, **out})
        if new != current:
            decision = {"step": self.step, "from": current.label, "to": new.label,
                        "reason": why, "error": error}
            out["decision"] = decision
            self.decisions.append(decision)
        return out

    def validation(self, loss: float) -> bool:
        """Record a validation loss (averaged over the ranks, so that all decide alike);
        returns whether validation has stalled (`Policy.validation`). Collective."""
        model = self.model
        if model.comm.size > 1 or model.data_comm is not None:
            loss = self._reduced([float(loss)])[0]
        return self.policy.validation(loss)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps so that a resumed run decides as an uninterrupted one."""
        return {"policy": self.policy.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` and train with its setting."""
        self.policy.load_state_dict(state["policy"])
        self.step = state["step"]
        forward, backward = self.configs(self.policy.setting)
        if (forward, backward) != (self.model.forward_config, self.model.backward_config):
            self.model.set_solvers(forward, backward)
