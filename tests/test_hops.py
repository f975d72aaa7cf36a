"""The per-hop cost split of benchmarks.studies.hops: its counters, the check that a counting
run lines up with the timed run, and the split of a small training step on virtual ranks."""

import math
import sys
from dataclasses import replace

import pytest
import torch

from benchmarks.scaling.cases import CURVES
from benchmarks.studies import hops


def test_counters_see_python_calls_and_aten_ops_but_not_the_dispatch_machinery():
    a, b, c = torch.ones(1, 32), torch.ones(1, 32), torch.empty(1, 32)

    def view():
        return a.view(32)
    hops._calibrate()
    counts = hops._local.counts = hops._Counts()
    sys.setprofile(hops._profile)
    try:
        with hops._OpCounter():
            counts.active = True
            torch.add(a, b, out=c)          # an op, nothing allocated
            torch.add(a, b)                 # an op with a new output
            view()                          # a Python call and a view (no new storage)
            counts.active = False
    finally:
        sys.setprofile(None)
        del hops._local.counts
    got = dict(zip(hops.COUNTS, counts.n))
    assert (got["frames"], got["ops"], got["allocs"]) == (1, 3, 1), (
        f"expected 1 Python call and 3 ops of which 1 allocates, counted {got}")


def test_runs_whose_events_differ_are_refused():
    timed = [[["compute", 1.0], ["send", 1, 8, "w:0", 0]], [["wait", 0, "w:0", 0]]]
    hops.align(timed, [[["compute", 2.0], ["send", 1, 8, "w:0", 0]], [["wait", 0, "w:0", 0]]])
    for counted in ([[["compute", 1.0], ["send", 1, 8, "w:0", 1]], [["wait", 0, "w:0", 0]]],
                    [[["compute", 1.0]], [["wait", 0, "w:0", 0]]],
                    [[["send", 1, 8, "w:0", 0], ["compute", 1.0]], [["wait", 0, "w:0", 0]]],
                    timed[:1]):
        with pytest.raises(ValueError, match="align|ranks"):
            hops.align(timed, counted)


@pytest.mark.parametrize("mode", ["auto", "torch"])
def test_split_of_a_small_training_step_adds_up_to_its_measured_compute(mode, monkeypatch):
    """Native kernels (their compiled phases) and torch's (their planned phases): every
    layer step is counted, the parts add up, and the arithmetic-only replay lies between
    the arithmetic spread evenly over the ranks and the measured step."""
    monkeypatch.setenv("MGRIT_NATIVE", mode)
    case = replace(CURVES["w2"], name="w2-64", num_steps=64)
    result = hops.measure(case, 4, warmup=1, repeats=2, run=lambda fn, *args: fn(*args),
                          rounds=5)
    assert result["critical"]["hops"] > 0, "4 ranks exchange messages"
    for name, col in result["columns"].items():
        for part in ("dispatch", "allocation", "arithmetic"):
            assert col[part] >= 0, f"{name}: {part} is {col[part]}"
        parts = col["python"] + col["dispatch"] + col["allocation"] + col["arithmetic"]
        assert math.isclose(parts, col["compute"], rel_tol=1e-9, abs_tol=1e-12), (
            f"{name}: the parts sum to {parts}, the spans to {col['compute']}")
    critical, busy = result["columns"]["critical"], result["columns"]["busy"]
    assert math.isclose(critical["compute"], result["critical"]["compute"], rel_tol=1e-9), (
        "the critical spans must sum to the replay's critical compute")
    layers = {k: busy["counts"][k] for k in hops.COUNTS[4:]}
    assert busy["counts"]["frames"] > 0 and busy["counts"]["ops"] > 0, busy["counts"]
    assert layers["fwd_native"] + layers["fwd_torch"] >= 2 * 64, (
        f"two forward cycles step every layer at least once: {layers}")
    assert layers["adj_native"] + layers["adj_torch"] > 0, layers
    assert critical["counts"]["frames"] <= busy["counts"]["frames"], "the path is part of all"
    if mode == "torch":
        assert layers["fwd_native"] == layers["adj_native"] == 0, layers
    low, ideal = result["floor"], result["floor_no_latency"]
    assert math.isclose(low["arithmetic"], busy["arithmetic"], rel_tol=1e-9), (
        "the cut spans hold all ranks' arithmetic")
    assert low["arithmetic"] / 4 <= ideal["predicted"] <= low["predicted"]
    assert low["predicted"] < result["predicted"]
    assert low["critical"]["hops"] > 0 and ideal["critical"]["communication"] >= 0


def test_every_hierarchy_variant_fits_w2_and_predicts_a_step():
    """The hierarchy study's variants are valid MGRIT hierarchies for W2's 1024 layers
    (each level as asked, coarsest level of at least one step), and one of them runs on
    two virtual ranks to a prediction with message hops."""
    from benchmarks.studies.hierarchies import VARIANTS, config, variant_point
    from mgrit.app.replay import Interconnect
    from mgrit.core.grid import build_hierarchy

    for name, (levels, coarsening, relax) in VARIANTS.items():
        cfg = config("forward", levels, coarsening, relax)
        grids = build_hierarchy(1024, cfg.coarsening_list(), cfg.levels, cfg.min_coarse)
        assert len(grids) == levels and grids[-1].num_steps >= 1, name
    point = variant_point("3 levels, m = 16, 4, F/FCF", 2, Interconnect(5e-6, 1e10, 1e-6),
                          repeats=1, warmup=1)
    assert point["seconds"] > 0 and point["critical"]["hops"] > 0


def test_a_hierarchy_case_is_w2_with_that_hierarchy_and_travels_to_fresh_processes():
    """`--variant`'s case: W2's workload with the variant's settings in both solves (the
    rest of W2 as it is), and a value that a fresh process can be handed."""
    import pickle

    from benchmarks.studies.hierarchies import VARIANTS, HierarchyCase, config

    base = CURVES["w2"].work()
    for name, (levels, coarsening, relax) in VARIANTS.items():
        case = pickle.loads(pickle.dumps(HierarchyCase(name)))
        work = case.work()
        assert case.name == name
        assert work.forward == config("forward", levels, coarsening, relax)
        assert work.backward == config("backward", levels, coarsening, relax)
        assert work.network().num_steps == base.network().num_steps == 1024
