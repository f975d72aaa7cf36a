"""The chosen-settings study (`benchmarks.studies.nested`): the gradient error it reports
against serial autograd's gradient, and the options it hands its MPI launches as JSON."""

import json
import math

import pytest
import torch

from benchmarks.studies import nested
from benchmarks.training import build, gradient_pairs, hierarchy

# settings of the kinds `choose_settings` picks: one cycle from zero, and no cycle from a
# nested start (the coarse levels' solution F-relaxed once)
ONE_CYCLE = {"levels": 3, "coarsening": 8, "relax": ("F", "F"), "max_iter": 1,
             "initial_guess": "zero"}
NO_CYCLE = {"levels": 2, "coarsening": 16, "relax": ("F",), "max_iter": 0,
            "initial_guess": "nested"}


def _serial_error(options: dict) -> float:
    """|g - g_serial| / |g_serial| over every parameter, from one training gradient of the
    layer-parallel model with `options` and one of the serial network (same weights)."""
    work = nested.work_of("w2", options)
    model, serial = build(work)
    x, y = work.inputs(torch.Generator().manual_seed(1))
    work.loss(model(x), y).backward()
    work.loss(serial(x), y).backward()
    pairs = gradient_pairs(model, serial)
    diff = sum(float((a.double() - b.double()).square().sum()) for a, b in pairs)
    norm = sum(float(b.double().square().sum()) for _, b in pairs)
    return math.sqrt(diff / norm)


@pytest.mark.parametrize("solve", [ONE_CYCLE, NO_CYCLE], ids=["one-cycle", "no-cycle"])
def test_gradient_error_matches_serial_autograd(solve):
    options = {"forward": solve, "backward": solve}
    reference = _serial_error(options)
    assert reference > 1e-3          # an inexact setting: the check below can tell them apart
    assert nested.gradient_error(nested.work_of("w2", options)) == pytest.approx(reference,
                                                                                 rel=1e-3)


def test_exact_stepping_has_no_gradient_error():
    exact = {"levels": 1, "coarsening": 4, "relax": ("F",), "max_iter": 1,
             "initial_guess": "zero"}
    assert nested.gradient_error(nested.work_of("w2", {"forward": exact,
                                                       "backward": exact})) < 1e-6


def test_options_survive_the_launch_arguments():
    """What a launch reads back from its JSON argument builds the same solvers."""
    options = {"forward": NO_CYCLE, "backward": ONE_CYCLE}
    work = nested.work_of("w2", options)
    again = nested.work_of("w2", json.loads(json.dumps(hierarchy(work))))
    assert again.forward == work.forward and again.backward == work.backward
    assert work.forward.max_iter == 0 and work.forward.initial_guess == "nested"
    assert work.backward.levels == 3 and work.backward.coarsening == 8


@pytest.mark.parametrize("ranks, layers", [(1, 1024), (64, 16), (1000, 2)])
def test_a_ranks_share_is_stepped_exactly(ranks, layers):
    """The study's bound steps the most layers a rank holds (rounded up), exactly."""
    assert nested.share_layers("w2", ranks) == layers
    work = nested.share_work("w2", ranks)
    model, _ = build(work)
    assert model.num_steps == layers
    assert work.forward.levels == work.backward.levels == 1


def test_unknown_case_is_refused():
    with pytest.raises(ValueError, match="w2, w1-1024"):
        nested.work_of("w3")
