"""Trusting inexact gradients: the probe measures the error against an exact gradient computed
independently, probes leave training as it was, the policy decides as documented on made-up
measurements, and on several ranks the controller decides alike and trains exactly once it
has chosen exact stepping."""

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

import mgrit
from mgrit.nn import Controller, Policy, Setting, draws, probe
from mgrit.nn.controller import EXACT_SETTING, solve_cost
from mgrit.nn.defaults import training_config

from nets import build, cosine, data, owned_pairs, relative

INEXACT_F = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=2,
                         min_coarse=1)
INEXACT_B = replace(INEXACT_F, max_iter=1)


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y)


# measuring -------------------------------------------------------------------------------

def test_probe_measures_the_error_against_serial_autograds_gradient():
    """The probe's exact gradient is serial autograd's; its cosine and relative error are
    those of the training gradient against serial autograd's, computed independently here;
    and the parameters keep the training gradient."""
    model, serial = build("dense", 16, INEXACT_F, INEXACT_B)
    x, y = data("dense", 6)
    loss_fn(model(x), y).backward()
    held = [p.grad for p in model.parameters()]
    values = [g.clone() for g in held]
    stats, draw_step = copy.deepcopy(model.stats), model.draw_step
    result = probe(model, lambda: loss_fn(model(x), y))
    assert all(p.grad is g and torch.equal(g, v)
               for p, g, v in zip(model.parameters(), held, values))
    assert model.stats == stats and model.draw_step == draw_step
    loss_fn(serial(x), y).backward()
    pairs = owned_pairs(model, serial, grad=True)
    assert 1e-4 < result.error < 1.0               # measurably inexact
    assert result.error == pytest.approx(relative(pairs), rel=1e-9)
    assert result.cosine == pytest.approx(cosine(pairs), rel=1e-12)
    layer_pairs = pairs[:len(pairs) - 4]            # opening and closing: 2 tensors each
    assert result.agreement["layers"]["relative_error"] == pytest.approx(
        relative(layer_pairs), rel=1e-9)
    # the probe's own gradient is the exact one
    for p, g in zip(model.parameters(), result.gradients):
        p.grad = g
    assert relative(owned_pairs(model, serial, grad=True)) <= 1e-12


def test_a_probe_evaluates_the_random_draws_of_the_step_it_checks():
    """With dropout in the layers, the probe of training step k draws step k's masks: its
    gradient is serial autograd's under `draws(seed, k)`."""
    def step():
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.3))

    torch.manual_seed(3)
    opening, closing = nn.Linear(5, 8), nn.Linear(8, 3)
    model = mgrit.LayerParallel(step, 12, 1.0, INEXACT_F, INEXACT_B, opening=opening,
                                closing=closing, seed=7).double()
    torch.manual_seed(3)
    opening, closing = nn.Linear(5, 8), nn.Linear(8, 3)
    serial = mgrit.serial_resnet(step, 12, 1.0, opening, closing).double()
    x, y = data("dense", 6)
    for k in range(2):
        model.zero_grad()
        loss_fn(model(x), y).backward()
        result = probe(model, lambda: loss_fn(model(x), y))
        assert model.draw_step == k + 1
        serial.zero_grad()
        with draws(7, k):
            loss_fn(serial(x), y).backward()
        for p, g in zip(model.parameters(), result.gradients):
            p.grad = g
        assert relative(owned_pairs(model, serial, grad=True)) <= 1e-12, k


class Watching(Policy):
    """Probes like the default policy but never measures other settings: nothing changes."""

    def wanted(self, error):
        return []


def watching(every):
    return Watching(Setting(2, 1, 3), lambda s: 1.0, every=every, max_every=every,
                    warm_trials=False)


def _train(model, x, y, steps, controller=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if controller is not None:
            controller.after_backward(lambda: loss_fn(model(x), y))
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_probes_leave_training_exactly_as_it_was():
    """Warm-started solves, probes every second step: the same parameters, bit for bit, as
    training without a controller."""
    warm_f, warm_b = (replace(c, initial_guess="warm") for c in (INEXACT_F, INEXACT_B))
    x, y = data("dense", 6)
    plain, _ = build("dense", 16, warm_f, warm_b)
    watched, _ = build("dense", 16, warm_f, warm_b)
    controller = Controller(watched, policy=watching(2))
    expected = _train(plain, x, y, 6)
    got = _train(watched, x, y, 6, controller)
    assert len(controller.probes) == 3
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert watched.stats["control"]["setting"] == "2/1 L3"


def test_set_solvers_rebuilds_the_solvers_and_keeps_warm_starts():
    """Setting the same options again mid-run changes nothing (the warm-start states carry
    over); other options take effect at the next pass; a pending backward pass and options
    the layers cannot hold are refused."""
    warm_f, warm_b = (replace(c, initial_guess="warm") for c in (INEXACT_F, INEXACT_B))
    x, y = data("dense", 6)
    plain, _ = build("dense", 16, warm_f, warm_b)
    reset, _ = build("dense", 16, warm_f, warm_b)
    _train(plain, x, y, 2)
    _train(reset, x, y, 2)
    reset.set_solvers(forward=warm_f, backward=warm_b)
    assert not reset._passes.adjoint_solvers
    expected, got = _train(plain, x, y, 2), _train(reset, x, y, 2)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    reset.set_solvers(forward=replace(warm_f, max_iter=3, levels=2))
    reset(x)
    assert reset.stats["forward"]["iterations"] == 3
    out = reset(x)
    reset.set_solvers(forward=warm_f)
    with pytest.raises(RuntimeError, match="older forward pass"):
        loss_fn(out, y).backward()
    with pytest.raises(ValueError, match="too small"):
        reset.set_solvers(forward=replace(warm_f, levels=6, relax="F"))
    assert reset.forward_config == warm_f


# deciding ---------------------------------------------------------------------------------

BASE = Setting(2, 1, 4)


def made_up_cost(s):
    """Cycles price a setting, fewer levels a little more, except that two levels are cheap
    (as on one rank), and exact stepping costs twice the base."""
    table = {EXACT_SETTING: 2.0, Setting(2, 1, 2): 0.85}
    return table.get(s, (s.forward + 2 * s.backward) / 4 * (1 + 0.05 * (4 - s.levels)))


def _policy(**options):
    return Policy(BASE, made_up_cost, **{"threshold": 0.25, "every": 10, "max_every": 40,
                                         "warm_trials": False, **options})


def test_the_policy_climbs_to_the_cheapest_setting_within_threshold():
    p = _policy()
    assert p.due(0, None)
    # one cycle more, fewer levels, exact; not what costs as much as exact stepping
    assert p.wanted(0.8) == [Setting(2, 2, 4), Setting(3, 1, 4), Setting(2, 1, 3),
                             Setting(2, 1, 2), EXACT_SETTING]
    measured = {Setting(2, 2, 4): 0.16, Setting(3, 1, 4): 0.7, Setting(2, 1, 3): 0.15,
                Setting(2, 1, 2): 0.3, EXACT_SETTING: 0.0}
    assert p.decide(0, 0.8, measured) == (Setting(2, 1, 3), "error above threshold")
    # probes every `every` steps after a change; an estimate only once calibrated
    assert not p.due(9, None) and p.due(10, None)
    assert p.estimate(0.01) is None
    # within the target at the new setting: stay, calibrate, probe half as often
    assert p.wanted(0.15) == []
    assert p.decide(10, 0.15, {}, indicator=0.01) == (Setting(2, 1, 3), "within threshold")
    assert p.interval == 20 and p.estimate(0.02) == pytest.approx(0.3)
    # an estimate above the threshold brings the next probe forward (not before `every`)
    assert not p.due(19, 0.3) and p.due(20, 0.3) and not p.due(20, 0.2)
    assert p.due(30, None)


def test_the_policy_searches_on_where_only_exact_stepping_meets_the_threshold():
    p = _policy()
    step_on = {Setting(2, 2, 4): 1.0, Setting(3, 1, 4): 1.5, Setting(2, 1, 3): 0.6,
               Setting(2, 1, 2): 0.9, EXACT_SETTING: 0.0}
    assert p.decide(0, 1.5, step_on)[0] == Setting(2, 1, 3)
    # nothing cuts the error by CUT: exact stepping
    assert p.wanted(0.6) == [Setting(2, 2, 3), Setting(3, 1, 3), Setting(2, 1, 2),
                             EXACT_SETTING]
    nothing = {Setting(2, 2, 3): 0.5, Setting(3, 1, 3): 0.55, Setting(2, 1, 2): 0.45,
               EXACT_SETTING: 0.0}
    assert p.decide(10, 0.6, nothing)[0] == EXACT_SETTING
    assert p.came_from == Setting(2, 1, 3)
    # at exact stepping the error is zero; after two quiet probes (a climb makes the
    # policy wait for two) the way back is measured and taken where it is cheaper and
    # within the target
    assert p.wanted(0.0) == []
    p.decide(20, 0.0, {})
    assert p.wanted(0.0) == [Setting(2, 1, 3), BASE]
    assert p.decide(40, 0.0, {Setting(2, 1, 3): 0.1, BASE: 0.3}) == (
        Setting(2, 1, 3), "cheaper within threshold")


def test_the_policy_backs_off_when_nothing_cheaper_is_found_and_on_a_plateau():
    p = _policy()
    assert p.wanted(0.05) == [Setting(2, 1, 2)]          # the only cheaper setting
    assert p.decide(0, 0.05, {Setting(2, 1, 2): 0.3}) == (
        BASE, "nothing cheaper within threshold")
    assert p.quiet_needed == 2 and p.interval == 20
    assert p.wanted(0.05) == []                          # waits for two quiet probes
    p.decide(20, 0.05, {})
    assert p.interval == 40                              # doubled, at most max_every
    assert p.wanted(0.05) == [Setting(2, 1, 2)]
    assert p.decide(60, 0.05, {Setting(2, 1, 2): 0.1})[0] == Setting(2, 1, 2)
    # validation stalls: the next step is probed, and nothing cheaper is tried meanwhile
    for loss in (1.0, 0.8, 0.7, 0.7, 0.7):
        assert not p.validation(loss)
    assert p.validation(0.7) and p.plateau
    assert p.due(61, None)
    p.decide(61, 0.01, {})
    assert not p.due(62, None)
    assert p.wanted(0.01) == [] and p.quiet == 0
    assert not p.validation(0.5) and not p.plateau


def test_the_policy_tries_warm_starts_and_keeps_them_only_where_they_help():
    p = _policy(warm_trials=True)
    # within the threshold but not well below: warm starts are tried (they cost nothing)
    assert p.decide(0, 0.2, {}) == (Setting(2, 1, 4, warm=True), "trying warm starts")
    assert p.interval == 10
    assert p.decide(10, 0.1, {}) == (Setting(2, 1, 4, warm=True), "warm starts helped")
    # a move keeps them
    assert Setting(2, 2, 4, warm=True) in p.wanted(0.4)
    q = _policy(warm_trials=True)
    q.decide(0, 0.2, {})
    assert q.decide(10, 0.19, {}) == (BASE, "warm starts did not help")
    assert q.warm_wait == 2
    q.decide(20, 0.2, {})
    q.decide(30, 0.2, {})
    assert q.setting == BASE                     # waits two probes before the next trial
    assert q.decide(40, 0.2, {})[1] == "trying warm starts"
    # a trial that ends above the threshold climbs, without warm starts
    assert q.decide(50, 0.8, {Setting(2, 1, 3, warm=True): 0.1})[0] == Setting(2, 1, 3)
    assert q.warm_wait == 4


def test_the_policy_state_round_trips():
    p = _policy()
    p.decide(0, 0.8, {Setting(2, 2, 4): 0.1, EXACT_SETTING: 0.0})
    p.validation(0.9)
    q = _policy()
    q.load_state_dict(copy.deepcopy(p.state_dict()))
    assert q.state_dict() == p.state_dict() and q.setting == Setting(2, 2, 4)
    assert q.decide(10, 0.9, {EXACT_SETTING: 0.0}) == p.decide(10, 0.9, {EXACT_SETTING: 0.0})


def test_bad_policy_options_are_named():
    for options, words in (({"threshold": 0}, "threshold"), ({"every": 0}, "every"),
                           ({"every": 10, "max_every": 5}, "max_every"),
                           ({"max_cycles": 0}, "max_cycles")):
        with pytest.raises(ValueError, match=words):
            Policy(BASE, made_up_cost, **options)


def test_the_cost_model_prices_cycles_levels_and_exact_stepping():
    """More cycles cost more; exact stepping costs 3N single steps whatever the ranks;
    many ranks make MGRIT cheap, and then fewer levels (a longer sequential coarse solve)
    cost more."""
    model, _ = build("dense", 256, training_config("forward", 4, 4),
                     training_config("backward", 4, 4))
    controller = Controller(model, batching=6.0)
    cost = controller.cost
    assert cost(Setting(2, 1, 4)) < cost(Setting(2, 2, 4)) < cost(Setting(3, 2, 4))
    assert cost(EXACT_SETTING) == pytest.approx(3 * 256 * (1 + 1 / 6))
    fwd = training_config("forward", 5, 4)
    many = [solve_cost(replace(fwd, levels=levels), 1024, 64) for levels in (5, 3, 2)]
    exact = solve_cost(replace(fwd, levels=1, max_iter=1), 1024, 64)
    assert many[0] < many[1] < many[2] < exact
    assert many[0] < solve_cost(fwd, 1024, 1) / 3


# on several ranks -------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_training_is_exact_once_the_controller_decides_exact_stepping(mpi, nprocs):
    """Dense network of 13 layers (uneven blocks), float64, a controller whose policy
    chooses exact stepping at its first probe: from then on training equals serial
    training of the exported network on every rank count, and every rank took the same
    decisions."""
    run = mpi("controller.py", nprocs, "exact", timeout=240)
    assert run.returncode == 0, run.stderr
    reports = run.by_rank()
    assert reports[0]["parameters"] <= 1e-10
    assert reports[0]["setting"] == "exact"
    assert len({str(r["decisions"]) for r in reports.values()}) == 1


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_every_rank_takes_the_same_decisions(mpi, nprocs):
    """A network whose gradients at 2/1 cycles are far off (T = 6), the default policy with
    a low threshold and frequent probes: decisions, probed errors and costs are the same on
    every rank, although each rank's own times differ."""
    run = mpi("controller.py", nprocs, "collective", timeout=240)
    assert run.returncode == 0, run.stderr
    reports = run.by_rank()
    assert reports[0]["decisions"], "the case should make the controller act"
    for key in ("decisions", "probes", "costs", "setting"):
        assert len({str(r[key]) for r in reports.values()}) == 1, key
