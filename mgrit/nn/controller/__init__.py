"""How far to trust the gradients of inexact MGRIT, and keeping them trustworthy.

Training solves each pass with a few MGRIT cycles, so its gradients are not the network's
exact gradients. This package measures by how much and acts on it:

- `gradient_agreement`: cosine similarity and relative error of one gradient against
  another, per parameter group (opening, layers, closing) and overall, from sums over the
  ranks, so that every rank gets the same numbers;
- `probe`: the gradient of the training step just taken computed again with other solver
  options (by default exact stepping, `levels=1`: one sequential sweep each way), without
  disturbing the step: the parameters' gradients are the training step's again afterwards;
- `solve_cost`, `solve_seconds`: a model of what a solve costs on the critical path (calls,
  intervals, march steps, hops), priced by a fixed batching gain or by a `Calibration`
  measured on the network's own layers (`calibrate`), so that settings are priced alike on
  every rank and in every rerun; `choose_settings` picks the cheapest hierarchy by it;
- `Policy`: the decisions alone, from measured errors and modelled costs: when to probe,
  which other settings to measure, which to train with (more cycles, fewer levels, exact
  stepping when the error is too large; cheaper settings when it stays well below);
- `Controller`: probes every few steps, lets the policy decide and changes the solvers of
  the model (`LayerParallel.set_solvers`) to keep the measured error below a threshold at
  the least cost.

The jobs live apart: `agreement`, `probe`, `cost`, `calibrate`, `choose` (settings before
training), `hierarchy` (settings as solver options, and which the layers allow), `policy`
and `control` (the `Controller`).

Every decision follows from numbers that are the same on every rank (sums reduced over the
layer-parallel group, or the caller's values averaged over it), so all ranks decide alike.
"""

from .agreement import GROUPS, gradient_agreement, mean_over_ranks
from .calibrate import calibrate
from .choose import choose_settings
from .control import Controller
from .cost import (BATCHING, LATENCY, Calibration, Terms, Units, fit, solve_cost,
                   solve_seconds, solve_terms, step_seconds)
from .policy import (CUT, EVERY, EXACT_SETTING, LOWER, MAX_CYCLES, MAX_EVERY, MOST_QUIET,
                     PLATEAU, SAVING, TARGET, THRESHOLD, WARM_GAIN, Moves, Policy, Setting)
from .probe import EXACT, ProbeResult, probe, probe_gradients, probe_solves

__all__ = ["BATCHING", "CUT", "EVERY", "EXACT", "EXACT_SETTING", "GROUPS", "LATENCY", "LOWER",
           "MAX_CYCLES", "MAX_EVERY", "MOST_QUIET", "PLATEAU", "SAVING", "TARGET",
           "THRESHOLD", "WARM_GAIN", "Calibration", "Controller", "Moves", "Policy",
           "ProbeResult", "Setting", "Terms", "Units", "calibrate", "choose_settings", "fit",
           "gradient_agreement", "mean_over_ranks", "probe", "probe_gradients",
           "probe_solves", "solve_cost", "solve_seconds", "solve_terms", "step_seconds"]
