"""The controller's cost model priced by measurement: the fit recovers known prices, a model
fitted on W2's measured solves (docs/results/work-settings.json) predicts the held-out
settings and ranks them as the measurement does on one rank, and more levels at 64 modelled
ranks; calibrating on a network leaves training as it was; hierarchies the layers cannot
hold are never candidates; the policy moves between hierarchies only on measured errors;
on several ranks every rank calibrates, prices and chooses alike."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mgrit.core.grid import build_hierarchy
from mgrit.nn import Controller, Policy, Setting, calibrate, choose_settings
from mgrit.nn.controller import (EXACT_SETTING, Calibration, Moves, Terms, Units, fit,
                                 solve_seconds, solve_terms, step_seconds)
from mgrit.nn.controller.hierarchy import cheapest, configs_of, hierarchies, valid
from mgrit.nn.defaults import training_config

from nets import ForcedPolicy, build, data

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results" / "work-settings.json"
HELD_OUT = ("2 levels", "3 levels", "default", "5 levels")


# fitting --------------------------------------------------------------------------------

def test_the_fit_recovers_known_prices_and_repeats_exactly():
    """Solves timed as a known price would time them (plus hops at the given latency) give
    that price back, the same on every fit."""
    truth = Units(call=3e-6, interval=2e-7, step=4e-7)
    configs = [replace(training_config("forward", levels, m), max_iter=cycles)
               for levels, m, cycles in ((2, 2, 1), (2, 8, 2), (3, 4, 1), (4, 4, 2))]
    configs.append(replace(training_config("forward"), levels=1, max_iter=1))
    samples = [(solve_terms(c, 256, 4), truth.price(solve_terms(c, 256, 4), 5e-5))
               for c in configs]
    got = fit(samples, latency=5e-5)
    for name in ("call", "interval", "step"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert fit(samples, latency=5e-5) == got
    # no price is negative, even where timings contradict the model
    odd = [(Terms(10, 100, 0, 0), 1e-3), (Terms(1, 10, 0, 0), 5e-3), (Terms(0, 0, 50, 0), 1e-4)]
    assert all(v >= 0 for v in vars(fit(odd)).values())


def test_hops_count_messages_on_the_path():
    """One rank has no hops; exact stepping over P ranks passes P - 1 boundaries (and one
    reduction of log2 P); more levels shorten the coarsest level's chain through the ranks."""
    exact = replace(training_config("forward"), levels=1, max_iter=1)
    assert solve_terms(exact, 1024, 1).hops == 0
    assert solve_terms(exact, 1024, 64) == Terms(0, 0, 1024, 63 + 6)
    two, four = (training_config("forward", levels, 4) for levels in (2, 4))
    assert solve_terms(two, 1024, 1).hops == solve_terms(four, 1024, 1).hops == 0
    # the coarsest level's march: 256 steps over 64 ranks, against 16 over 16
    assert solve_terms(two, 1024, 64).steps == 2 * 256
    assert solve_terms(four, 1024, 64).steps == 2 * 16


# the model against W2's measurements ------------------------------------------------------

def _records(workload: str) -> list[dict]:
    return [r for r in json.loads(RESULTS.read_text())["records"]
            if r["workload"] == workload and not r["warm"]]


def _configs(r: dict):
    """The solver options benchmarks/settings.py measured a record with."""
    if r["levels"] == 1:
        return (replace(training_config("forward"), levels=1, max_iter=1),) * 2
    out = []
    for cycles in (r["forward"], r["backward"]):
        cfg = training_config("forward", r["levels"], r["m"])
        relax = cfg.relax if r["relax"] == "F/FCF" else (r["relax"],) * (r["levels"] - 1)
        out.append(replace(cfg, relax=relax, max_iter=cycles, cycle=r["cycle"]))
    return tuple(out)


def _fitted(records: list[dict], stat: str) -> Calibration:
    """Units fitted on the records' forward solves and on their training steps less the
    forward pass (the adjoint solve and the rest of the step)."""
    forward, backward = [], []
    for r in records:
        f, b = _configs(r)
        seconds = r["seconds"]
        forward.append((solve_terms(f, 1024, 1), seconds["forward"][stat]))
        backward.append((solve_terms(b, 1024, 1),
                         seconds["train_step"][stat] - seconds["forward"][stat]))
    return Calibration(fit(forward), fit(backward))


@pytest.mark.parametrize("stat", ["min", "median"])
def test_a_model_fitted_on_w2_ranks_its_settings_as_measured(stat):
    """Fitted on W2's other settings, the model predicts the held-out settings' forward
    solves within 25%, prices 2 levels below 3 levels and below the default on one rank,
    as the training steps measured (min and median), and at 64 modelled ranks prices the
    default 4 levels below 2 and 3 levels and chooses a hierarchy of 3 or more levels."""
    records = _records("w2")
    by_name = {r["name"]: r for r in records}
    cal = _fitted([r for r in records if r["name"] not in HELD_OUT], stat)
    for name in HELD_OUT:
        f, _ = _configs(by_name[name])
        measured = by_name[name]["seconds"]["forward"][stat]
        assert solve_seconds(f, 1024, 1, cal.forward) == pytest.approx(measured, rel=0.25)

    def modelled(name, ranks):
        return step_seconds(*_configs(by_name[name]), 1024, ranks, cal)

    def measured(name):
        return by_name[name]["seconds"]["train_step"][stat]

    assert measured("2 levels") < measured("3 levels") and measured("2 levels") < measured(
        "default")
    assert modelled("2 levels", 1) < modelled("3 levels", 1) < modelled("default", 1)
    assert modelled("default", 64) < min(modelled("2 levels", 64), modelled("3 levels", 64))
    # the choice among every valid hierarchy at the default's cycles
    f, b = _configs(by_name["default"])
    options = hierarchies(Setting(2, 1, 4), f, b, 1024, 5)
    one, many = (cheapest(options, f, b, 1024, ranks, cal)[0][1] for ranks in (1, 64))
    assert one.levels == 2 and many.levels >= 3
    # W1: its measured cheapest setting, 2 levels coarsened by 8, beats the default
    w1 = {r["name"]: r for r in _records("w1")}
    fw, bw = (_configs(w1[n]) for n in ("coarsening 8, 2 levels", "default"))
    assert w1["coarsening 8, 2 levels"]["seconds"]["train_step"][stat] < \
        w1["default"]["seconds"]["train_step"][stat]


# hierarchies ------------------------------------------------------------------------------

def test_only_hierarchies_the_layers_hold_with_stable_coarse_steps_are_candidates():
    """Every candidate builds all its levels on both passes and its coarsest step spans at
    most the user's coarsest step; the moves reach coarsenings and levels the user did not
    set."""
    f, b = training_config("forward", 3, 4), training_config("backward", 3, 4)
    options = hierarchies(Setting(2, 1, 3), f, b, 32, 4)
    assert options
    for s in options:
        for cfg in configs_of(s, f, b, 3):
            grids = build_hierarchy(32, cfg.coarsening_list(), cfg.levels, cfg.min_coarse)
            assert len(grids) == cfg.levels == s.levels
            assert grids[-1].stride <= 16
    found = {(s.levels, s.coarsening) for s in options}
    assert {(2, 2), (2, 4), (2, 8), (2, 16), (3, 2), (3, 4), (4, 2)} == found
    assert not valid(Setting(2, 1, 3, coarsening=8), f, b, 3, 32)   # 64 > 16 layers a step
    assert not valid(Setting(2, 1, 4, coarsening=4), f, b, 3, 32)   # 32 // 4**3 == 0


def _moving_policy():
    f, b = training_config("forward", 3, 4), training_config("backward", 3, 4)
    base = Setting(2, 1, 3, coarsening=4, coarse="FCF")

    def cost(s):
        # cheaper with fewer cycles, larger coarsening and F below the fine level
        if s.exact:
            return 10.0
        return ((s.forward + 2 * s.backward) * (1 + 4 / s.coarsening)
                * (0.8 if s.coarse == "F" else 1.0))
    moves = Moves(4, valid=lambda s: valid(s, f, b, 3, 32))
    return Policy(base, cost, threshold=0.25, every=10, max_every=40, warm_trials=False,
                  moves=moves), base


def test_the_policy_moves_between_hierarchies_only_where_measured_errors_allow():
    """Well below the threshold the cheaper moves are measured: cycles below the user's, a
    level more, a larger coarsening, F below the fine level; the cheapest within the target
    is taken, one whose measured error misses the target is not."""
    p, base = _moving_policy()
    wanted = p.wanted(0.01)
    assert replace(base, forward=1) in wanted                # below the user's cycles
    assert replace(base, coarse="F") in wanted
    assert replace(base, coarsening=8) not in wanted         # coarsest step too long
    assert all(p.cost(s) < 0.9 * p.cost(base) for s in wanted)
    measured = {s: 0.5 for s in wanted}                      # all miss the target
    assert p.decide(0, 0.01, measured) == (base, "nothing cheaper within threshold")
    p, base = _moving_policy()
    measured = {s: 0.1 for s in p.wanted(0.01)}
    measured[replace(base, forward=1)] = 0.2                 # 0.2 > 0.7 * 0.25
    new, why = p.decide(0, 0.01, measured)
    assert why == "cheaper within threshold"
    assert new == min((s for s, e in measured.items() if e <= 0.175), key=p.cost)
    assert new != replace(base, forward=1)
    # above the threshold: FCF below the fine level and a smaller coarsening are among
    # the more accurate moves
    p, base = _moving_policy()
    p.setting = replace(base, coarse="F")
    assert replace(base, coarse="FCF") in p.wanted(0.9)
    assert replace(base, coarse="F", coarsening=2) in p.wanted(0.9)


def test_the_policy_moves_to_nested_starts_down_to_no_cycle_where_allowed():
    """With `Moves(nested=True)`, a cycle less from a nested start is a cheaper move, down
    to no cycle; without, neither; a pass of no cycle is never given a warm start (a warm
    trial there is not offered), and nothing else drops a pass to no cycle."""
    f, b = training_config("forward", 3, 4), training_config("backward", 3, 4)
    base = Setting(1, 1, 3, coarsening=4, coarse="FCF")

    def cost(s):
        if s.exact:
            return 10.0
        return (s.forward + 0.5 * s.nested + 2 * s.backward + s.nested_backward)

    def policy(nested, warm_trials=False):
        moves = Moves(4, nested=nested, valid=lambda s: valid(s, f, b, 3, 32))
        return Policy(base, cost, threshold=0.25, every=10, max_every=40,
                      warm_trials=warm_trials, moves=moves)

    wanted = policy(True).wanted(0.01)
    assert replace(base, forward=0, nested=True) in wanted
    assert replace(base, backward=0, nested_backward=True) in wanted
    assert not any(s.forward == 0 and not s.nested for s in wanted)
    assert not any((s.forward, s.backward) == (0, 0) for s in wanted)   # one move at a time
    assert not any(s.nested or s.nested_backward for s in policy(False).wanted(0.01))
    p = policy(True)
    measured = {s: 0.1 for s in p.wanted(0.01)}
    new, why = p.decide(0, 0.01, measured)
    assert why == "cheaper within threshold" and new == min(measured, key=cost)
    # at no cycle, between LOWER and 1 times the threshold: no warm trial (not a solve)
    p = policy(True, warm_trials=True)
    p.setting = replace(base, forward=0, nested=True)
    p.since_trial = 99
    assert p.decide(0, 0.2, {}) == (p.setting, "within threshold")
    # a cycle more from there keeps the nested start
    assert replace(base, forward=1, nested=True) in p.wanted(0.9)


def test_a_controller_prices_for_the_ranks_it_is_given():
    f, b = training_config("forward", 3, 4), training_config("backward", 3, 4)
    model, _ = build("dense", 64, f, b)
    cal = Calibration(Units(2e-5, 1e-7, 2e-6), Units(3e-5, 2e-7, 3e-6))
    setting = Setting(2, 1, 3, coarsening=4, coarse="FCF")
    for ranks in (1, 8):
        controller = Controller(model, calibration=cal, ranks=ranks)
        assert controller.cost(setting) == step_seconds(f, b, 64, ranks, cal)
    # hops and shares of the work differ: a single rank's price is not 8 ranks'
    assert Controller(model, calibration=cal, ranks=8).cost(setting) != \
        Controller(model, calibration=cal).cost(setting)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="ranks"):
            Controller(model, ranks=bad)


# calibrating on a network -----------------------------------------------------------------

def test_calibrating_leaves_training_as_it_was_and_prices_from_the_measurement():
    """Calibration times exact stepping and a few hierarchies: its units are positive and
    reproduce exact stepping's forward solve, timed apart, within a factor of 3; the parameters'
    gradients, the solver options and the next training step are untouched; a controller
    given the calibration prices settings from it alone, the same every time."""
    f, b = training_config("forward", 3, 4), training_config("backward", 3, 4)
    model, _ = build("dense", 64, f, b)
    x, y = data("dense", 8)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    cal = calibrate(model, x, repeats=2)
    assert all(p.grad is not None and torch.equal(p.grad, g)
               for p, g in zip(model.parameters(), grads))
    assert (model.forward_config, model.backward_config) == (f, b)
    assert cal.forward.step > 0 and cal.backward.step > 0
    assert cal.forward.call + cal.forward.interval > 0
    exact = replace(f, levels=1, max_iter=1)
    times = []
    for _ in range(4):          # the fastest of a few, as calibration takes them
        with model.probing(exact, replace(b, levels=1, max_iter=1)) as stats:
            model(x).square().mean().backward()
        times.append(stats["forward"]["seconds"])
    timed = min(times[1:])
    assert timed / 3 < solve_seconds(exact, 64, 1, cal.forward) < 3 * timed
    controller = Controller(model, calibration=cal)
    setting = Setting(2, 1, 3, coarsening=4, coarse="FCF")
    assert controller.cost(setting) == step_seconds(f, b, 64, 1, cal)
    assert controller.cost(setting) == Controller(model, calibration=cal).cost(setting)
    assert controller.base == setting
    # the hierarchy chosen for this network by the same numbers is among the valid ones
    chosen = choose_settings(model, x, calibration=cal)
    assert all(len(build_hierarchy(64, c.coarsening_list(), c.levels, 1)) == c.levels
               for c in chosen)
    assert chosen[0].max_iter == 2 and chosen[1].max_iter == 1


def test_probes_time_solves_to_the_devices_end_and_training_steps_do_not(monkeypatch):
    """On a GPU a solve's launches return before its kernels end: inside `probing` (what
    calibration and the controller time) the clock waits for the solve's device before and
    after each solve; a training step's never does, so the host stays ahead of the device.
    The clock's readings are recorded with whether they wait; a stand-in CUDA tensor shows
    whom the wait is for."""
    f, b = training_config("forward", 2, 4), training_config("backward", 2, 4)
    model, _ = build("dense", 16, f, b)
    x, y = data("dense", 4)
    clock, waits = type(model)._clock, []
    monkeypatch.setattr(type(model), "_clock",
                        lambda self, t: waits.append(self._timed) or clock(self, t))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert waits == [False] * 4             # forward and adjoint, start and end
    with model.probing(f, b) as stats:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    assert waits[4:] == [True] * 4 and stats["forward"]["seconds"] > 0
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert waits[8:] == [False] * 4         # the probe's setting ends with it
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    gpu = type("OnGpu", (), {"is_cuda": True, "device": torch.device("cuda", 1)})()
    model._timed = True
    clock(model, gpu), clock(model, x)
    model._timed = False
    clock(model, gpu)
    assert synced == [torch.device("cuda", 1)]


def test_bad_calibration_options_are_named():
    model, _ = build("dense", 32)
    x, _ = data("dense", 2)
    for options, words in (({"repeats": 0}, "repeats"), ({"latency": -1.0}, "latency")):
        with pytest.raises(ValueError, match=words):
            calibrate(model, x, **options)
    with pytest.raises(ValueError, match="latency"):
        Controller(model, latency=-1.0)
    with pytest.raises(TypeError, match="calibration"):
        Controller(model, calibration={"forward": 1})
    with pytest.raises(ValueError, match="ranks"):
        choose_settings(model, x, ranks=0, calibration=Calibration(
            Units(1, 1, 1), Units(1, 1, 1)))
    with pytest.raises(RuntimeError, match="not calibrated"):
        Controller(model).cost(EXACT_SETTING)


@pytest.mark.mpi
def test_every_rank_calibrates_and_chooses_alike(mpi):
    """Two ranks time their own solves (their seconds differ) but fit, price and choose
    from the mean, and measure errors reduced over both: the calibration, the chosen
    options (by price, and by price and measured error) and the controller's prices are the
    same on both."""
    run = mpi("controller.py", 2, "calibrated", timeout=240)
    assert run.returncode == 0, run.stderr
    reports = run.by_rank()
    assert reports[0]["calibration"]["forward"]["step"] > 0
    for key in ("calibration", "chosen", "measured", "costs"):
        assert reports[0][key] == reports[1][key], key



def test_a_hierarchy_move_trains_as_a_model_built_with_those_options():
    """A move to more levels than the user's, another coarsening and F below the fine level
    and one forward cycle fewer: the next step's gradient is the one a model built with the
    options the move names computes (same weights, same batch)."""
    f = replace(training_config("forward", 3, 2), min_coarse=1)
    b = replace(training_config("backward", 3, 2), min_coarse=1)
    model, _ = build("dense", 16, f, b)
    x, y = data("dense", 6)
    loss_fn = torch.nn.functional.cross_entropy
    target = Setting(1, 1, 4, coarsening=2, coarse="F")
    controller = Controller(model, policy=ForcedPolicy(Setting(2, 1, 3, coarsening=2,
                                                          coarse="FCF"), target))
    loss_fn(model(x), y).backward()
    controller.after_backward(lambda: loss_fn(model(x), y))
    forward, backward = model.forward_config, model.backward_config
    assert (forward.levels, forward.max_iter, forward.relax) == (4, 1, ("F", "F", "F"))
    assert (backward.levels, backward.max_iter) == (4, 1)
    model.zero_grad()
    loss_fn(model(x), y).backward()
    fresh, _ = build("dense", 16, forward, backward)
    loss_fn(fresh(x), y).backward()
    for a, b_ in zip(model.parameters(), fresh.parameters()):
        assert torch.allclose(a.grad, b_.grad, rtol=1e-10, atol=1e-12)


# choosing with a measured error -----------------------------------------------------------

def _dense_with_a_gradient():
    """Training options of 3 levels, m = 4, a 64-layer dense model built with them, the
    closure of its loss on a batch, and the gradients of one backward pass, which it holds."""
    f, b = training_config("forward", 3, 4), training_config("backward", 3, 4)
    model, _ = build("dense", 64, f, b)
    x, y = data("dense", 8)
    closure = lambda: torch.nn.functional.cross_entropy(model(x), y)  # noqa: E731
    closure().backward()
    return f, b, model, closure, [p.grad.clone() for p in model.parameters()]


def _timed_by_price(monkeypatch, cal: Calibration, num_steps: int, log: list) -> None:
    """`choose_settings` times its settings by their model price instead of the clock
    (logged in `log`): a choice among timed settings that does not depend on the machine."""
    from mgrit.nn.controller import choose

    def seconds(model, closure, settings, repeats):
        log.extend(settings)
        return [step_seconds(*configs, num_steps, model.comm.size, cal) for configs in settings]
    monkeypatch.setattr(choose, "_solve_seconds", seconds)


def test_a_chosen_setting_meets_the_threshold_against_serial_autograd(monkeypatch):
    """With a threshold, the chosen settings' gradient (a model built with them) lies
    within TARGET * threshold of serial autograd's; fewer cycles are taken where they meet
    it; an unreachable threshold gives exact stepping, a lax one the fastest candidate
    (timed here by price: no cycle, from nested starts, below the choice at the options'
    cycles). The parameters' gradients and the model's options are as they were."""
    from benchmarks.training import gradient_agreement, gradient_pairs
    from mgrit.nn.controller import TARGET
    f, b, model, closure, grads = _dense_with_a_gradient()
    x, y = data("dense", 8)
    cal = Calibration(Units(2e-5, 1e-7, 2e-6), Units(3e-5, 2e-7, 3e-6))
    _timed_by_price(monkeypatch, cal, 64, [])
    chosen = choose_settings(model, closure, calibration=cal, threshold=0.25,
                             exact_passes=False)
    assert all(p.grad is not None and torch.equal(p.grad, g)
               for p, g in zip(model.parameters(), grads))
    assert (model.forward_config, model.backward_config) == (f, b)
    again, serial = build("dense", 64, *chosen)
    torch.nn.functional.cross_entropy(again(x), y).backward()
    torch.nn.functional.cross_entropy(serial(x), y).backward()
    error = gradient_agreement(gradient_pairs(again, serial))["relative_error"]
    assert error <= TARGET * 0.25 + 1e-9
    # this network's gradients meet it with fewer forward cycles than the options' two
    assert chosen[0].levels > 1 and chosen[0].max_iter < 2
    # nothing but exact stepping meets an error of 1e-12
    exact = choose_settings(model, closure, calibration=cal, threshold=1e-12)
    assert [c.levels for c in exact] == [1, 1]
    # every candidate meets a lax threshold: the cheapest is no cycle from nested starts
    lax = choose_settings(model, closure, calibration=cal, threshold=1e6, exact_passes=False)
    plain = choose_settings(model, closure, calibration=cal)
    assert [(c.max_iter, c.initial_guess) for c in lax] == [(0, "nested")] * 2
    assert step_seconds(*lax, 64, 1, cal) < step_seconds(*plain, 64, 1, cal)
    assert [c.max_iter for c in plain] == [2, 1]


def test_nested_settings_start_their_passes_from_the_coarse_solution():
    f, b = training_config("forward", 3, 4), training_config("backward", 3, 4)
    setting = Setting(1, 1, 2, coarsening=8, nested=True)
    forward, backward = configs_of(setting, f, b, 3)
    assert (forward.initial_guess, backward.initial_guess) == ("nested", "zero")
    assert forward.max_iter == 1 and forward.coarsening == 8
    assert "nested" in setting.label and "nested" not in replace(setting, nested=False).label
    assert Setting(*setting.as_list()) == setting
    # settings saved before the flags existed load as not nested
    assert Setting(*setting.as_list()[:6]) == replace(setting, nested=False)
    both = configs_of(replace(setting, nested_backward=True), f, b, 3)
    assert [c.initial_guess for c in both] == ["nested", "nested"]
    # no cycle is a solve only from a nested start, and only where the options start at zero
    assert valid(Setting(0, 1, 2, coarsening=8, nested=True), f, b, 3, 64)
    assert not valid(Setting(0, 1, 2, coarsening=8), f, b, 3, 64)
    assert not valid(Setting(1, 0, 2, coarsening=8, nested=True), f, b, 3, 64)
    assert not valid(Setting(0, 1, 2, coarsening=8, nested=True),
                     replace(f, initial_guess="warm"), b, 3, 64)
    # the cost model prices the coarse solve it adds
    assert step_seconds(forward, backward, 64, 1, Calibration(Units(1, 1, 1), Units(1, 1, 1))) \
        > step_seconds(*configs_of(replace(setting, nested=False), f, b, 3), 64, 1,
                       Calibration(Units(1, 1, 1), Units(1, 1, 1)))


def test_bad_choice_options_are_named():
    model, _ = build("dense", 32)
    x, _ = data("dense", 2)
    cal = Calibration(Units(1, 1, 1), Units(1, 1, 1))
    for options, words in (({"threshold": 0}, "threshold"), ({"threshold": "0.2"}, "threshold"),
                           ({"threshold": 0.2, "trials": 0}, "trials"),
                           ({"most_levels": 1}, "most_levels")):
        with pytest.raises(ValueError, match=words):
            choose_settings(model, x, calibration=cal, **options)


def test_settings_that_step_one_pass_exactly_are_candidates_priced_as_sweeps():
    """With `exact_passes`, every candidate hierarchy comes with the forward or the backward
    pass stepped exactly (levels 1, one sweep): its own cycles and start leave the
    validity checks, the other pass keeps its hierarchy, and the model prices the exact
    pass as a march over every rank."""
    from mgrit.nn.controller.choose import candidates
    f, b = training_config("forward", 3, 4), training_config("backward", 3, 4)
    base = Setting(2, 1, 3)
    plain = candidates(base, f, b, 64, 4, fewer_cycles=True)
    both = candidates(base, f, b, 64, 4, fewer_cycles=True, exact_passes=True)
    assert not any(s.exact_pass for s in plain) and set(plain) < set(both)
    extra = [s for s in both if s not in plain]
    assert {s.exact_pass for s in extra} == {"forward", "backward"}
    for s in extra:
        forward, backward = configs_of(s, f, b, 3)
        exact, other = (forward, backward) if s.exact_pass == "forward" else (backward, forward)
        assert (exact.levels, exact.max_iter, exact.initial_guess) == (1, 1, "zero")
        assert other.levels >= 2 and valid(s, f, b, 3, 64)
        assert f"exact-{s.exact_pass}" in s.label
        assert Setting(*s.as_list()) == s
    # the exact pass's cycles do not matter; the other pass's rules still hold
    assert valid(Setting(0, 0, 2, coarsening=8, nested_backward=True, exact_pass="forward"),
                 f, b, 3, 64)
    assert not valid(Setting(1, 0, 2, coarsening=8, exact_pass="forward"), f, b, 3, 64)
    with pytest.raises(ValueError, match="exact_pass"):
        Setting(1, 1, 2, exact_pass="both")
    # a sweep of 64 layers on 4 ranks: 64 steps and 3 hops to the last rank, then the
    # reduction's 2
    cal = Calibration(Units(1.0, 0.0, 0.0), Units(0.0, 0.0, 1.0), latency=10.0)
    s = Setting(1, 1, 2, coarsening=8, exact_pass="backward")
    assert solve_terms(configs_of(s, f, b, 3)[1], 64, 4) == Terms(0, 0, 64, 5)
    assert step_seconds(*configs_of(s, f, b, 3), 64, 4, cal) == pytest.approx(
        solve_seconds(configs_of(s, f, b, 3)[0], 64, 4, cal.forward, 10.0) + 64 + 50)


def test_the_choice_is_the_fastest_setting_that_meets_the_threshold(monkeypatch):
    """Of the `trials` cheapest candidates, those whose gradient meets the threshold are
    timed beside exact stepping (here by a fixed clock) and the fastest is chosen: exact
    stepping where it is the fastest or within MARGIN of it, a setting with an exact pass
    where that is; a setting that misses the threshold is never timed; `exact_passes=False`
    leaves exact passes out."""
    from mgrit.nn.controller import choose
    f, b = training_config("forward", 3, 4), training_config("backward", 3, 4)
    model, _ = build("dense", 64, f, b)
    x, y = data("dense", 8)
    closure = lambda: torch.nn.functional.cross_entropy(model(x), y)  # noqa: E731
    cal = Calibration(Units(2e-5, 1e-7, 2e-6), Units(3e-5, 2e-7, 3e-6))
    timed = []

    def clock(fast):
        def seconds(model, closure, settings, repeats):
            timed.extend(settings)
            return [1.0 if fast(configs) else 2.0 for configs in settings]
        monkeypatch.setattr(choose, "_solve_seconds", seconds)

    clock(lambda c: c[0].levels == 1 and c[1].levels == 1)
    assert [c.levels for c in choose_settings(model, closure, calibration=cal,
                                              threshold=1e6)] == [1, 1]
    assert len(timed) == choose.TRIALS + 1           # every trial met the lax threshold

    clock(lambda c: c[0].levels == 1 and c[1].levels > 1)
    forward, backward = choose_settings(model, closure, calibration=cal, threshold=1e6,
                                        trials=40)
    assert forward.levels == 1 and backward.levels > 1

    timed.clear()
    clock(lambda c: c[0].levels > 1 and c[1].levels > 1)
    chosen = choose_settings(model, closure, calibration=cal, threshold=1e6,
                             exact_passes=False)
    assert all(c.levels > 1 for c in chosen)
    assert all(c.levels > 1 for pair in timed for c in pair)

    # a setting within MARGIN of exact stepping's time does not replace it; a faster one does
    for exact_seconds, levels in ((1.0 + 0.8 * choose.MARGIN, [1, 1]),
                                  (1.0 + 1.5 * choose.MARGIN, [2, 2])):
        def seconds(model, closure, settings, repeats, _exact=exact_seconds):
            return [_exact if c[0].levels == 1 and c[1].levels == 1 else (
                1.0 if c[0].levels > 1 and c[1].levels > 1 else 9.0) for c in settings]
        monkeypatch.setattr(choose, "_solve_seconds", seconds)
        chosen = choose_settings(model, closure, calibration=cal, threshold=1e6)
        assert [min(c.levels, 2) for c in chosen] == levels

    # nothing inexact meets 1e-12: only exact stepping is timed, and chosen
    timed.clear()
    clock(lambda c: False)
    assert [c.levels for c in choose_settings(model, closure, calibration=cal,
                                              threshold=1e-12)] == [1, 1]
    assert [[c.levels for c in pair] for pair in timed] == [[1, 1]]


def test_settings_are_timed_in_turns_and_leave_training_as_it_was(monkeypatch):
    """`_solve_seconds` probes the settings in rounds, each timed probe after an untimed
    one of the same settings, and gives each the sum of its passes' fastest seconds; the
    parameters' gradients and training's options are as they were."""
    from mgrit.nn.controller import choose
    f, b, model, closure, grads = _dense_with_a_gradient()
    exact = configs_of(EXACT_SETTING, f, b, 3)
    nested = configs_of(Setting(0, 0, 2, coarsening=8, nested=True, nested_backward=True),
                        f, b, 3, cold=True)
    order, probe = [], choose.probe_solves

    def logged(model, closure, forward, backward):
        order.append(forward.levels)
        return probe(model, closure, forward, backward)
    monkeypatch.setattr(choose, "probe_solves", logged)
    seconds = choose._solve_seconds(model, closure, [exact, nested], 2)
    assert order == [1, 1, 2, 2] * 2
    assert len(seconds) == 2 and all(0 < s < 10 for s in seconds)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert (model.forward_config, model.backward_config) == (f, b)


def test_a_controller_trains_on_from_settings_with_an_exact_pass():
    """Settings with an exact forward pass, as `choose_settings` may return, train under a
    controller that probes every step: its moves keep the forward pass exact (a setting
    names fewer levels than those options have only by going exact everywhere) and its
    setting says so, every probe measures an error, and the gradient at the end matches
    serial autograd's to within the threshold the controller keeps."""
    from benchmarks.training import gradient_agreement, gradient_pairs
    from mgrit.app.loop import train_step
    f, b = training_config("forward", 3, 4), training_config("backward", 3, 4)
    setting = Setting(1, 0, 2, coarsening=8, nested_backward=True, exact_pass="forward")
    forward, backward = configs_of(setting, f, b, 3, cold=True)
    model, serial = build("dense", 64, forward, backward)
    x, y = data("dense", 8)
    loss_fn = torch.nn.functional.cross_entropy
    # priced for 64 ranks, where exact stepping costs a march through every rank
    controller = Controller(model, every=1, max_every=1, ranks=64,
                            calibration=Calibration(Units(2e-5, 1e-7, 2e-6),
                                                    Units(3e-5, 2e-7, 3e-6)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    assert controller.setting.exact_pass == "forward"
    for _ in range(4):
        train_step(model, optimizer, loss_fn, x, y, control=controller)
        assert model.forward_config.levels == 1 and model.backward_config.levels >= 2
        assert 0 <= controller.last["probe"]["error"] < 1
        assert controller.last["setting"].endswith("exact-forward")
    # the step's gradient against serial autograd's at the same weights
    serial.load_state_dict(model.to_serial().state_dict())
    model.zero_grad()
    serial.zero_grad()
    loss_fn(model(x), y).backward()
    loss_fn(serial(x), y).backward()
    error = gradient_agreement(gradient_pairs(model, serial))["relative_error"]
    assert error <= controller.policy.threshold


def test_the_cheapest_exact_pass_settings_are_measured_even_past_the_trials():
    """Where settings are timed, the cheapest with the forward and the cheapest with the
    backward pass exact are measured even when the model ranks them past `trials`: it
    leaves out the fixed costs an exact pass saves. Untimed, only the trials are."""
    from mgrit.nn.controller.choose import _trials
    plain = [Setting(1, 1, 2, coarsening=m) for m in (2, 4, 8)]
    forward = [Setting(1, 0, 2, coarsening=m, exact_pass="forward") for m in (4, 8)]
    backward = [Setting(1, 1, 2, coarsening=m, exact_pass="backward") for m in (4, 8)]
    ranked = plain + [forward[0], backward[0], forward[1], backward[1]]
    assert _trials(ranked, 2, timed=True) == plain[:2] + [forward[0], backward[0]]
    assert _trials(ranked, 2, timed=False) == plain[:2]
    # one of each among the trials already: nothing is added
    assert _trials(ranked, 5, timed=True) == ranked[:5]
    assert _trials(ranked, 4, timed=True) == ranked[:4] + [backward[0]]
