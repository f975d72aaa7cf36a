"""`benchmarks.settings`: its settings build the solver options they name, and its gradient
error is measured against the exact gradient (serial autograd of the same weights)."""

from __future__ import annotations

from dataclasses import replace

import torch

from benchmarks.settings import Setting, candidates, gradient_error
from benchmarks.workloads import TRAINING_WORKLOADS, digits_dense

N = 16


def _small():
    base = TRAINING_WORKLOADS["w2"]()
    return replace(base, name="digits", network=lambda: digits_dense(16, N),
                   inputs=lambda g: (torch.randn(4, 64, generator=g),
                                     torch.randint(0, 10, (4,), generator=g)))


def test_candidates_change_one_option_each() -> None:
    settings = candidates(3)
    base = next(s for s in settings if s.name == "default")
    cfg = base.config(2)
    assert (cfg.levels, cfg.coarsening, cfg.relax, cfg.max_iter) == (3, 4, ("F", "FCF"), 2)
    assert Setting("x", 3, relax="F").config(1).relax == ("F", "F")
    assert Setting("x", 3, warm=True).config(1).initial_guess == "warm"
    for s in settings[2:]:
        changed = [k for k in ("levels", "m", "relax", "cycle", "forward", "backward", "warm")
                   if getattr(s, k) != getattr(base, k)]
        assert 1 <= len(changed) <= 2, (s.name, changed)


def test_gradient_error_is_against_the_exact_gradient() -> None:
    """Two-level MGRIT with F-relaxation is exact after N/m cycles (the coarse solve moves
    the exact value one interval a cycle): its error is rounding, that of one cycle is not;
    and the sequential network's own gradient matches serial autograd's."""
    work = _small()
    exact = Setting("exact", 2, relax="F", forward=N // 4, backward=N // 4)
    one = Setting("one", 2, relax="F", forward=1, backward=1)
    assert gradient_error(work, exact)["relative_error"] < 1e-5
    err = gradient_error(work, one)
    assert err["relative_error"] > 1e-4
    assert err["output_relative_error"] > 1e-5


def test_sequential_gradient_matches_serial_autograd() -> None:
    from benchmarks.training import build, gradient_agreement, gradient_pairs

    work = Setting("seq", 1).apply(_small())
    model, serial = build(work)
    x, y = work.inputs(torch.Generator().manual_seed(3))
    work.loss(model(x), y).backward()
    work.loss(serial(x), y).backward()
    assert gradient_agreement(gradient_pairs(model, serial))["relative_error"] < 1e-5


def test_hierarchy_labels_name_the_passes_that_start_nested():
    from benchmarks.training import hierarchy_label
    forward = {"levels": 2, "coarsening": 8, "relax": ["F"], "max_iter": 0,
               "initial_guess": "nested"}
    backward = dict(forward, max_iter=1, initial_guess="zero")
    assert hierarchy_label({"forward": forward, "backward": backward}) == \
        "L2 m8 F 0/1 nested forward"
    assert hierarchy_label({"forward": forward, "backward": dict(forward)}) == \
        "L2 m8 F 0/0 nested"
    # records written before the start was kept read as zero starts
    plain = {k: v for k, v in backward.items() if k != "initial_guess"}
    assert hierarchy_label({"forward": plain, "backward": plain}) == "L2 m8 F 1/1"
    gathered = dict(forward, agglomerate=1)
    assert hierarchy_label({"forward": gathered, "backward": gathered}) == \
        "L2 m8 F 0/0 nested gathered"
    # a pass stepped exactly is named, the other pass's hierarchy follows
    exact = {"levels": 1, "coarsening": 4, "relax": ["F"], "max_iter": 1,
             "initial_guess": "zero"}
    assert hierarchy_label({"forward": exact, "backward": dict(forward)}) == \
        "exact forward, L2 m8 F 0 backward nested"
    assert hierarchy_label({"forward": backward, "backward": exact}) == \
        "exact backward, L2 m8 F 1 forward"
    assert hierarchy_label({"forward": exact, "backward": exact}) == "exact"
