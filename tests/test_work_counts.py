"""The layer-evaluation counts of `benchmarks.work` against counts derived by hand from the
cycle's definition (docs/solver.md): sequential stepping and two-level F-relaxation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from benchmarks.work import ratios, step_work
from benchmarks.workloads import TRAINING_WORKLOADS, digits_dense
from mgrit.core.config import Config
from mgrit.nn.controller import solve_terms

N, M = 16, 4


def _digits_workload(forward: Config, backward: Config):
    base = TRAINING_WORKLOADS["w2"]()
    return replace(base, name="digits", network=lambda: digits_dense(16, N),
                   forward=forward, backward=backward,
                   inputs=lambda g: (torch.randn(4, 64, generator=g),
                                     torch.randint(0, 10, (4,), generator=g)))


def test_sequential_stepping_is_n_forward_and_n_adjoint() -> None:
    one = Config(levels=1, tol=0.0, max_iter=1)
    counts = step_work(_digits_workload(one, one))
    assert counts["train_step"]["forward_by_level"] == {0: N}
    assert counts["train_step"]["adjoint_by_level"] == {0: N}
    assert counts["forward"]["forward_by_level"] == {0: N}
    assert counts["train_step"]["adjoint_nonzero"] == N     # the loss's gradient is not zero
    assert ratios(counts)["train_total"] == 1.0


@pytest.mark.parametrize("cycles", [(1, 1), (2, 1), (3, 2)])
def test_two_level_f_relaxation(cycles: tuple[int, int]) -> None:
    """Per solve of K cycles (tol 0): the first F-relaxation (N - N/m), the first
    restriction's Phi at the C-points (N/m), and per cycle on level 1 the FAS right-hand
    side's coarse Phi at the restricted states and the coarse sweep (N/m steps each), on
    level 0 the F-relaxation after the correction and the residual's Phi at the C-points
    (N - N/m + N/m), which the next restriction reuses."""
    kf, kb = cycles
    cfg = lambda k: Config(levels=2, coarsening=M, relax="F", cycle="V", tol=0.0,  # noqa: E731
                           max_iter=k, min_coarse=1)
    counts = step_work(_digits_workload(cfg(kf), cfg(kb)))
    fine = lambda k: (N - N // M) + N // M + k * N  # noqa: E731
    assert counts["train_step"]["forward_by_level"] == {0: fine(kf), 1: 2 * kf * N // M}
    assert counts["train_step"]["adjoint_by_level"] == {0: fine(kb), 1: 2 * kb * N // M}
    assert counts["forward"]["forward_by_level"] == {0: fine(kf), 1: 2 * kf * N // M}


@pytest.mark.parametrize("levels", [2, 3])
def test_a_nested_start_adds_what_the_cost_model_counts(levels: int) -> None:
    """A nested forward start (`initial_guess="nested"`) adds the coarse levels' solve
    before the first cycle: on two levels exactly one coarse sweep (N/m steps on level 1);
    on any, as many evaluations as the cost model's terms add (`solve_terms`, one rank)."""
    cfg = lambda guess: Config(levels=levels, coarsening=M, relax="F", tol=0.0,  # noqa: E731
                               max_iter=1, min_coarse=1, initial_guess=guess)
    zero, nested = (step_work(_digits_workload(cfg(g), cfg("zero")))["forward"]
                    for g in ("zero", "nested"))
    added = {lv: n - zero["forward_by_level"].get(lv, 0)
             for lv, n in nested["forward_by_level"].items()}
    if levels == 2:
        assert added == {0: 0, 1: N // M}
    assert sum(added.values()) > 0
    tz, tn = solve_terms(cfg("zero"), N, 1), solve_terms(cfg("nested"), N, 1)
    assert sum(added.values()) == (tn.intervals + tn.steps) - (tz.intervals + tz.steps)
