"""The controller: probes every few steps, lets the policy decide and changes the solvers
of the model (`LayerParallel.set_solvers`) to keep the measured error below a threshold at
the least cost."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from torch import Tensor

from ...core.config import Config
from ...core.cycle import DivergenceError
from ..layer_parallel import LayerParallel
from .agreement import GROUPS, gradient_agreement, mean_over_ranks
from .calibrate import calibrate
from .cost import LATENCY, Calibration, solve_cost, step_seconds
from .hierarchy import configs_of, starts_from_zero, uniform, valid
from .policy import (EVERY, EXACT_SETTING, MAX_CYCLES, MAX_EVERY, THRESHOLD, Moves, Policy,
                     Setting)
from .probe import probe_gradients

def _relative_residual(stats: dict[str, Any]) -> float:
    """The last residual of a solve relative to the norm of its given state (read on the
    host where a captured solve left them on the device)."""
    residuals, norm = stats.get("residuals"), float(stats.get("initial_norm", 0.0))
    last = float(residuals[-1]) if residuals is not None and len(residuals) else 0.0
    return last / norm if norm > 0 else 0.0


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

    Settings are priced by a model of the solves' critical path for the layer-parallel
    ranks (`cost.solve_terms`; `ranks` prices them for that many instead, e.g. to decide
    in one process as a run on P ranks would, whose arithmetic is the same), not by a
    stopwatch per decision, so that a run decides the
    same way every time it is run (resumed, traced, on another machine). Its prices come
    from a `Calibration` measured once, at the first probe, on the network's own layers
    and batch and averaged over the ranks (`calibrate`; given as `calibration`, nothing is
    measured; `latency`: seconds per hop), or, with `batching` given, from the fixed model
    in single-step calls (`solve_cost`, see `BATCHING`). With `hierarchies` (and options
    of one coarsening and one coarse relaxation) the policy also moves between hierarchies:
    a level more or fewer, coarsening 2, 4, 8 or 16, F or FCF below the fine level,
    cycles below the user's and, for a pass whose options start from zero, a cycle less
    from a nested start (down to none), each taken only where its measured error allows
    (`policy.Moves`, `hierarchy.valid`). Errors are sums reduced over the ranks (and
    the same on data-parallel replicas, whose gradients are averaged), validation losses
    are averaged over them: every rank decides alike. Every rank calls `after_backward` and
    `validation` (collective).

    `after_backward` returns the step's record (also in `model.stats["control"]` and
    `last`); `probes` and `decisions` keep the probed steps' and the changes' records.
    """

    def __init__(self, model: LayerParallel, threshold: float = THRESHOLD,
                 every: int = EVERY, max_every: int = MAX_EVERY,
                 max_cycles: int = MAX_CYCLES, batching: float | None = None,
                 warm_trials: bool = True, policy: Policy | None = None,
                 calibration: Calibration | None = None, latency: float = LATENCY,
                 hierarchies: bool = True, ranks: int | None = None) -> None:
        if not isinstance(model, LayerParallel):
            raise TypeError(f"model must be a mgrit.LayerParallel, got {type(model).__name__}")
        if batching is not None and (isinstance(batching, bool) or
                                     not isinstance(batching, (int, float)) or
                                     not 0 < batching < math.inf):
            raise ValueError(f"batching must be a positive number or None (measure the "
                             f"costs), got {batching!r}")
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) or \
                not 0 <= latency < math.inf:
            raise ValueError(f"latency must be a number >= 0 (seconds), got {latency!r}")
        if calibration is not None and not isinstance(calibration, Calibration):
            raise TypeError(f"calibration must be a Calibration, got "
                            f"{type(calibration).__name__}")
        if ranks is not None and (isinstance(ranks, bool) or not isinstance(ranks, int)
                                  or ranks < 1):
            raise ValueError(f"ranks must be an int >= 1 or None (the model's own), got "
                             f"{ranks!r}")
        self.model = model
        self.ranks = model.comm.size if ranks is None else ranks
        self.batching = None if batching is None else float(batching)
        self.calibration = calibration
        self.latency = float(latency)
        self.forward_config, self.backward_config = model.forward_config, model.backward_config
        f, b = self.forward_config, self.backward_config
        self.base_levels = max(f.levels, b.levels)
        shape = uniform(f) if uniform(f) == uniform(b) else None
        # options that step one pass exactly and solve the other (as `choose_settings` may
        # give) name that pass, so that the setting's label says so
        exact = [kind for kind, c in (("forward", f), ("backward", b)) if c.levels == 1]
        self.base = Setting(f.max_iter, b.max_iter, self.base_levels,
                            all(c.initial_guess == "warm" for c in (f, b)),
                            *(shape if hierarchies and shape is not None else ()),
                            exact_pass=exact[0] if len(exact) == 1 else "")
        moves = None
        if hierarchies and shape is not None:
            moves = Moves(self.base_levels + 1,
                          nested=starts_from_zero(f) or starts_from_zero(b),
                          valid=lambda s: valid(s, f, b, self.base_levels, model.num_steps))
        # a policy of one's own (another rule, or a test's) decides from the same numbers
        self.policy = policy if policy is not None else Policy(
            self.base, self.cost, threshold, every, max_every, max_cycles, warm_trials,
            moves)
        self.step = 0
        self.last: dict[str, Any] = {}
        self.probes: list[dict[str, Any]] = []
        self.decisions: list[dict[str, Any]] = []

    @property
    def setting(self) -> Setting:
        return self.policy.setting

    def configs(self, setting: Setting, cold: bool = False) -> tuple[Config, Config]:
        """The forward and backward options of `setting` (`cold`: from a zero guess where
        the options would start warm; `hierarchy.configs_of`)."""
        return configs_of(setting, self.forward_config, self.backward_config,
                          self.base_levels, cold)

    def cost(self, setting: Setting) -> float:
        """The modelled cost of a training step's two solves with `setting` on this model's
        layer-parallel ranks: seconds from the calibration (`cost.step_seconds`), or with
        `batching` given single-step calls (`solve_cost`; an adjoint step counts twice a
        forward step)."""
        forward, backward = self.configs(setting)
        n, ranks = self.model.num_steps, self.ranks
        if self.batching is not None:
            return (solve_cost(forward, n, ranks, self.batching)
                    + 2 * solve_cost(backward, n, ranks, self.batching))
        if self.calibration is None:
            raise RuntimeError("the cost model is not calibrated yet: it is measured at the "
                               "first probe (after_backward), or give calibration=")
        return step_seconds(forward, backward, n, ranks, self.calibration)

    def _reduced(self, values: list[float]) -> list[float]:
        """The mean over the layer-parallel ranks and the data-parallel replicas."""
        return mean_over_ranks(self.model, values)

    def after_backward(self, closure: Callable[[], Tensor]) -> dict[str, Any]:
        """Record the step whose backward pass just ended and, where one is due, probe it
        and decide; `closure()` computes the step's loss again (the same batch through the
        model). Returns the step's record. Collective."""
        return self._record(closure, self.model.stats, updated=False)

    def after_step(self, closure: Callable[[], Tensor],
                   stats: dict[str, Any] | None = None) -> dict[str, Any]:
        """`after_backward` for a step whose backward pass and optimizer update ran where
        the controller could not look in between (`CapturedStep`, whose step is one CUDA
        graph): call it after the step, with `closure` computing the step's loss again and
        `stats` its passes' residuals (by default `model.stats`). A probe then computes the
        training setting's gradient again beside the exact one, both at the updated
        weights and from the setting's own start (a warm start counts as cold), and
        compares the two; it runs eagerly, outside any graph. Collective."""
        return self._record(closure, self.model.stats if stats is None else stats,
                            updated=True)

    def _record(self, closure: Callable[[], Tensor], stats: dict[str, Any],
                updated: bool) -> dict[str, Any]:
        model, policy = self.model, self.policy
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
            record["probe"] = self._probe(closure, indicator, updated)
        self.step += 1
        self.last = record
        model.stats["control"] = record
        return record

    def _probe(self, closure: Callable[[], Tensor], indicator: float,
               updated: bool = False) -> dict[str, Any]:
        model, policy = self.model, self.policy
        start = time.perf_counter()
        current = policy.setting
        if self.batching is None and self.calibration is None:
            # once, at the first probe: the step's own batch on the network's own layers
            self.calibration = calibrate(model, closure, latency=self.latency)
        if updated and not current.exact:
            # the weights moved since the training gradient: it is made again at these
            trained, _, _ = probe_gradients(model, closure, *self.configs(current, cold=True))
        else:
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
        return {"policy": self.policy.state_dict(), "step": self.step,
                "calibration": (self.calibration.as_dict() if self.calibration is not None
                                else None)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` and train with its setting."""
        self.policy.load_state_dict(state["policy"])
        self.step = state["step"]
        if state.get("calibration") is not None:
            # the resumed run prices settings as the interrupted one did
            self.calibration = Calibration.from_dict(state["calibration"])
        forward, backward = self.configs(self.policy.setting)
        if (forward, backward) != (self.model.forward_config, self.model.backward_config):
            self.model.set_solvers(forward, backward)
