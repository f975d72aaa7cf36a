"""The phase split of one rank's training step (benchmarks.studies.fixed): its spans follow
the step's boundaries in order and add up to the step, and the library is left unwrapped."""

import pytest

from benchmarks.studies import fixed
from mgrit.core.cycle import Solver
from mgrit.nn import layer_parallel


def test_spans_follow_the_step_and_add_up_to_it():
    originals = [getattr(owner, name) for owner, name, _ in fixed.BOUNDARIES]
    result = fixed.measure(layers=64, steps=3, warmup=1)
    assert [getattr(owner, name) for owner, name, _ in fixed.BOUNDARIES] == originals
    keys = list(result["spans"])
    labels = [key[3:] for key in keys]
    # two forward cycles and one backward cycle (W2's), each solve's residuals, gradients
    assert labels[0] == "step begins -> gradients zeroed"
    assert labels[-1] == "backward pass done -> update done"
    assert sum("cycle begins -> cycle ends" == label for label in labels) == 3
    assert sum("gradients begins -> gradients ends" == label for label in labels) == 1
    assert sum("solve begins" in label and "solve ends" not in label
               for label in labels) >= 2
    assert all(seconds > 0 for seconds in result["spans"].values())
    # the medians of the spans need not add up to the median step, but come close
    assert sum(result["spans"].values()) == pytest.approx(result["step"], rel=0.5)
    assert "| whole step (median) |" in fixed.table(result)
    assert Solver._solve is originals[0] and layer_parallel.layer_gradients is originals[-1]
