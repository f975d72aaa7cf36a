"""Evaluations on the critical path (`benchmarks.studies.pathwork`) against sequential
stepping's known work and against `benchmarks.work`'s independent count."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from benchmarks.scaling.cases import CURVES
from benchmarks.studies import hops
from benchmarks.studies.pathwork import path_work
from benchmarks.training import sequential_variant
from benchmarks.work import step_work

N = 64


@dataclass(frozen=True)
class _Case:
    name: str
    sequential: bool

    def work(self, num_steps: int | None = None):
        work = replace(CURVES["w2"], num_steps=N).work()
        return sequential_variant(work) if self.sequential else work


def _measure(case: _Case, ranks: int) -> dict:
    result = hops.measure(case, ranks, warmup=1, repeats=1, run=lambda fn, *a: fn(*a),
                          rounds=2)
    return path_work(result, N)


@pytest.mark.parametrize("ranks", [1, 2])
def test_sequential_stepping_is_n_evaluations_each_way(ranks: int) -> None:
    """All ranks together step every layer once each way; on one rank that is the path.
    On two the path may run through the other rank's fixed costs instead of a pass's
    evaluations (64 narrow layers cost less than a rank's set-up), so it holds at most
    all of them."""
    row = _measure(_Case("seq", True), ranks)
    assert (row["all_ranks_forward"], row["all_ranks_adjoint"]) == (1.0, 1.0), row
    if ranks == 1:
        assert (row["path_forward"], row["path_adjoint"], row["hops"]) == (1.0, 1.0, 0), row
    else:
        assert row["path_forward"] <= 1.0 and row["path_adjoint"] <= 1.0, row
        assert row["hops"] > 0, row


def test_one_rank_path_is_all_the_work_that_the_propagators_were_asked() -> None:
    case = _Case("mgrit", False)
    row = _measure(case, 1)
    counts = step_work(case.work())["train_step"]
    assert row["path_forward"] == row["all_ranks_forward"]
    assert row["path_adjoint"] == row["all_ranks_adjoint"]
    # the hop tool counts in the strategies and kernels: recomputed op outputs as forward
    # steps, and adjoint steps that do arithmetic (a zero cotangent does none)
    assert row["all_ranks_forward"] * N == counts["forward"] + counts["values"]
    assert row["all_ranks_adjoint"] * N == counts["adjoint_nonzero"] < counts["adjoint"]
