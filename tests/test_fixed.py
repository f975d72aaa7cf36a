"""The phase split of a rank's training step (benchmarks.studies.fixed): its spans follow
the step's boundaries in order and add up to the step, the library is left unwrapped, and
under MPI every rank reports a column of the same spans."""

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


def fine_labels(result):
    return [key[3:] for key in result["spans"]]


def test_the_nested_setting_splits_at_the_fine_boundaries():
    originals = [getattr(owner, name) for owner, name, _ in fixed.BOUNDARIES + fixed.FINE]
    result = fixed.measure(layers=64, steps=3, warmup=1, nested=True, fine=True)
    assert [getattr(owner, name) for owner, name, _ in fixed.BOUNDARIES + fixed.FINE] == originals
    labels = fine_labels(result)
    # no cycle: one nested start, one F-relaxation and one residual a pass, both passes
    # reduced at their end (tol = 0 over several levels)
    assert sum(label == "nested begins -> nested ends" for label in labels) == 2
    assert sum(label == "F-relaxation begins -> F-relaxation ends" for label in labels) == 2
    assert sum(label == "reduction begins -> reduction ends" for label in labels) == 2
    assert not any("cycle" in label for label in labels)
    assert labels.index("check begins -> check ends") < labels.index(
        "nested begins -> nested ends")
    assert sum(result["spans"].values()) == pytest.approx(result["step"], rel=0.5)


def test_the_sequential_setting_has_no_nested_start_and_settings_exclude_each_other():
    labels = fine_labels(fixed.measure(layers=64, steps=2, warmup=1, sequential=True,
                                       fine=True))
    assert "check begins -> check ends" in labels
    assert not any("nested" in label or "F-relaxation" in label for label in labels)
    with pytest.raises(ValueError, match="choose one"):
        fixed.measure(layers=64, steps=1, warmup=0, sequential=True, nested=True)


@pytest.mark.mpi
def test_two_ranks_report_a_column_each(mpi):
    run = mpi("fixed_split.py", 2, timeout=240)
    assert run.returncode == 0, run.stderr
    reports = run.reports()
    assert [r["ranks"] for r in reports] == [2, 2]
    # the same program on both ranks: the same spans, each with its own times
    assert list(reports[0]["spans"]) == list(reports[1]["spans"])
    assert reports[0]["columns"] == 2
    table = reports[0]["table"].splitlines()
    assert table[0] == "| span | rank 0 (us) | rank 1 (us) |"
    assert all(line.count("|") == 4 for line in table)
    assert any(line.startswith("| nested begins -> nested ends |") for line in table)


def test_torch_part_updates_every_parameter_and_leaves_mgrit_the_difference():
    """Torch's part runs the whole update (every parameter gets a gradient, as in the real
    step), and mgrit's part is what the real step takes beyond it."""
    result = fixed.torch_part(layers=16, steps=2, rounds=1)
    assert result["torch_part_updates_every_parameter"]
    for key in ("fastest", "median"):
        assert result["step"][key] > 0 and result["torch"][key] > 0
        assert result["mgrit"][key] == pytest.approx(result["step"][key]
                                                     - result["torch"][key])
    assert "| mgrit's part (the difference) |" in fixed.torch_part_table(result)


def test_the_hand_on_node_passes_the_state_and_gives_the_layers_their_gradients():
    import torch

    u = torch.randn(1, 4, requires_grad=True)
    w = torch.zeros(2, 4, 4, requires_grad=True)
    kept = [torch.full((2, 4, 4), 3.0)]
    out = fixed._HandOn.apply(kept, u, w)
    assert torch.equal(out, u) and out.data_ptr() != u.data_ptr()
    out.square().sum().backward()
    assert torch.equal(u.grad, 2 * u.detach())
    assert w.grad is not None and torch.equal(w.grad, kept[0])
