"""Bad input fails early with a message naming the problem; divergence is reported, not returned."""

import math
import warnings

import pytest
import torch

import mgrit
from mgrit.problems import Dahlquist


class CountingDahlquist(Dahlquist):
    """Dahlquist that counts its steps, to prove an error came before any work."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def step(self, u, s):
        self.calls += 1
        return super().step(u, s)

    def step_batch(self, states, steps):
        self.calls += 1
        return super().step_batch(states, steps)


U0 = torch.tensor(1.0, dtype=torch.float64)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(levels=0), ValueError, "levels must be >= 1"),
    (dict(levels=2.0), TypeError, "levels must be an int"),
    (dict(coarsening=1), ValueError, "coarsening must be >= 2"),
    (dict(levels=4, coarsening=[2, 1, 2]), ValueError, "coarsening must be >= 2"),
    (dict(levels=4, coarsening=[2, 2]), ValueError, "needs 3"),
    (dict(relax="CF"), ValueError, "'F', 'FCF'"),
    (dict(levels=3, relax=["F", "FFC"]), ValueError, "'F', 'FCF'"),
    (dict(cycle="W"), ValueError, "'V', 'F'"),
    (dict(initial_guess="random"), ValueError, "'zero', 'nested'"),
    (dict(tol_kind="rel"), ValueError, "'absolute', 'relative'"),
    (dict(execution="threads"), ValueError, "'auto', 'loop', 'batched'"),
    (dict(tol=-1.0), ValueError, "tol must be >= 0"),
    (dict(tol=math.nan), TypeError, "tol must be a finite number"),
    (dict(max_iter=-1), ValueError, "max_iter must be >= 0"),
    (dict(max_iter=0), ValueError, "max_iter=0 .*needs initial_guess='nested'"),
    (dict(relax_sweeps=0), ValueError, "relax_sweeps must be >= 1"),
    (dict(c_weight=0.0), ValueError, "c_weight must be > 0"),
    (dict(min_coarse=0), ValueError, "min_coarse must be >= 1"),
    (dict(divergence_factor=1.0), ValueError, "divergence_factor must be > 1"),
])
def test_bad_config_is_rejected_on_construction(kwargs, error, words):
    with pytest.raises(error, match=words):
        mgrit.Config(**kwargs)


def test_per_level_lists_are_accepted_and_frozen():
    cfg = mgrit.Config(levels=3, coarsening=[4, 2], relax=["F", "FCF"])
    assert cfg.coarsening == (4, 2) and cfg.coarsening_at(1) == 2 and cfg.relax_at(0) == "F"
    with pytest.raises(Exception):
        cfg.levels = 4


@pytest.mark.parametrize("num_steps,error,words", [
    (0, ValueError, "num_steps must be >= 1"),
    (-3, ValueError, "num_steps must be >= 1"),
    (8.0, TypeError, "num_steps must be an int"),
])
def test_bad_num_steps(num_steps, error, words):
    prop = CountingDahlquist()
    with pytest.raises(error, match=words):
        mgrit.solve(prop, U0, num_steps, 0.0, 1.0, mgrit.Config())
    assert prop.calls == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_u0(bad):
    prop = CountingDahlquist()
    with pytest.raises(ValueError, match="NaN or Inf"):
        mgrit.solve(prop, torch.tensor([1.0, bad], dtype=torch.float64), 8, 0.0, 1.0)
    assert prop.calls == 0


def test_finite_u0_whose_sum_overflows_is_accepted_and_complex_nan_is_not():
    big = torch.tensor([3e38, 3e38], dtype=torch.float32)      # finite; the sum is not
    res = mgrit.solve(Dahlquist(-1.0), big, 8, 0.0, 1.0, mgrit.Config(levels=1))
    assert torch.isfinite(res.final).all()
    bad = torch.tensor([1.0, complex(0.0, math.nan)], dtype=torch.complex128)
    prop = CountingDahlquist()
    with pytest.raises(ValueError, match="NaN or Inf"):
        mgrit.solve(prop, bad, 8, 0.0, 1.0)
    assert prop.calls == 0


@pytest.mark.parametrize("guess,words", [
    (torch.zeros(8, dtype=torch.float64), r"shape \(8,\).*expected shape \(9,\)"),
    (torch.zeros(9, 1, dtype=torch.float64), "expected shape"),
    (torch.zeros(9, dtype=torch.float32), "dtype torch.float32.*dtype torch.float64"),
])
def test_bad_guess_tensor(guess, words):
    prop = CountingDahlquist()
    with pytest.raises(ValueError, match=words):
        mgrit.solve(prop, U0, 8, 0.0, 1.0, mgrit.Config(initial_guess=guess))
    assert prop.calls == 0


def test_equal_end_times_and_non_numbers():
    with pytest.raises(ValueError, match="t1 must differ from t0"):
        mgrit.solve(Dahlquist(), U0, 8, 1.0, 1.0)
    with pytest.raises(TypeError, match="t1 must be a finite real number"):
        mgrit.solve(Dahlquist(), U0, 8, 0.0, math.inf)


def test_batched_execution_needs_step_batch():
    class LoopOnly:
        def step(self, u, s):
            return u

    with pytest.raises(ValueError, match="needs a propagator with step_batch"):
        mgrit.solve(LoopOnly(), U0, 8, 0.0, 1.0, mgrit.Config(execution="batched"))


def test_not_a_propagator():
    with pytest.raises(TypeError, match="no step"):
        mgrit.solve(object(), U0, 8, 0.0, 1.0)


class _StepOnly:
    """A propagator with `step` alone, counting its calls."""

    def __init__(self):
        self.calls = 0

    def step(self, u, s):
        self.calls += 1
        return u * 0.5


@pytest.mark.parametrize("name,meant", [
    ("step_bacth", "step_batch"), ("stepbatch", "step_batch"),
    ("step_batchinto", "step_batch_into"), ("step_int", "step_into"),
    ("graph_keys", "graph_key")])
def test_a_misspelt_optional_method_is_named_before_any_work(name, meant):
    prop = type("Prop", (_StepOnly,), {name: lambda self, *args: None})()
    with pytest.raises(TypeError, match=rf"Prop\.{name} looks like a misspelt {meant}\b"):
        mgrit.solve(prop, U0, 8, 0.0, 1.0)
    assert prop.calls == 0
    # with the method it was meant to be there as well, the other name is the user's own
    both = type("Both", (_StepOnly,), {name: lambda self: None,
                                       meant: lambda self, *args: None})()
    mgrit.Solver(both, U0, 8, 0.0, 1.0)


def test_methods_far_from_the_optional_names_are_left_alone():
    class Helpers(Dahlquist):
        def steps_taken(self):
            return 0

        def stepper(self):
            return None

    res = mgrit.solve(Helpers(), U0, 64, 0.0, 1.0, mgrit.Config(levels=2, tol=1e-12))
    assert res.converged


@pytest.mark.parametrize("attrs,words", [
    (dict(step_batch=3), "Prop.step_batch is int, not a method"),
    (dict(step_into=lambda self, u, s: None),
     r"Prop.step_into\(u, s\) cannot be called as step_into\(u, s, out, g\)"),
    (dict(graph_key=lambda self, extra: None),
     r"Prop.graph_key\(extra\) cannot be called as graph_key\(\)"),
])
def test_optional_methods_are_checked_once_when_the_solver_is_built(attrs, words):
    prop = type("Prop", (CountingDahlquist,), attrs)()
    with pytest.raises(TypeError, match=words):
        mgrit.Solver(prop, U0, 8, 0.0, 1.0)
    assert prop.calls == 0


def test_capabilities_are_found_once_and_name_the_protocols():
    from mgrit.core.propagator import (BatchedPropagator, Capabilities, InPlacePropagator,
                                       Propagator)

    prop = Dahlquist()
    caps = Capabilities.of(prop)
    assert caps.step == prop.step and caps.step_batch == prop.step_batch
    assert caps.step_into == prop.step_into
    assert caps.step_batch_into is None and caps.graph_key is None
    assert isinstance(prop, Propagator) and isinstance(prop, BatchedPropagator)
    assert isinstance(prop, InPlacePropagator)


def test_step_that_changes_dtype_is_named():
    class Widening:
        def step(self, u, s):
            return u.to(torch.complex128)

    with pytest.raises(TypeError, match="Widening.step returned.*complex128.*must keep both"):
        mgrit.solve(Widening(), U0, 8, 0.0, 1.0)


def test_step_batch_that_changes_shape_is_named():
    class Squeezing(Dahlquist):
        def step_batch(self, states, steps):
            return states[:1]

    with pytest.raises(TypeError, match="step_batch returned shape"):
        mgrit.solve(Squeezing(), U0, 16, 0.0, 1.0, mgrit.Config(levels=2))


def test_complex_lambda_needs_complex_state():
    with pytest.raises(TypeError, match="needs a complex state"):
        mgrit.solve(Dahlquist(1j), U0, 8, 0.0, 1.0)


def test_unstable_coarse_forward_euler_is_reported_with_history():
    # fine step 1 - 0.5 is stable; the coarsest step (m^3 h = 4) has |1 - 4| = 3 > 1
    prop = Dahlquist(-1.0, method="forward_euler")
    with pytest.raises(mgrit.DivergenceError, match="unstable coarse step") as info:
        mgrit.solve(prop, U0, 256, 0.0, 128.0,
                    mgrit.Config(levels=4, coarsening=2, relax="F", tol=1e-12, max_iter=50))
    history = info.value.residuals
    assert len(history) >= 2 and history[-1] > 1e4 * history[0]


def test_nan_residual_is_reported():
    class Overflowing(Dahlquist):
        def step_batch(self, states, steps):
            return states * math.inf

    with pytest.raises(mgrit.DivergenceError, match="residual nan|residual inf") as info:
        mgrit.solve(Overflowing(), U0, 32, 0.0, 1.0, mgrit.Config(levels=2, max_iter=5))
    assert len(info.value.residuals) == 1


def test_divergence_of_a_fixed_cycle_count_solve_is_reported_at_its_first_cycle():
    # tol = 0 runs every cycle and reduces the residuals once at the end; the report is the
    # same: the history up to the first cycle that diverged
    prop = Dahlquist(-1.0, method="forward_euler")
    config = dict(levels=4, coarsening=2, relax="F", max_iter=12)
    with pytest.raises(mgrit.DivergenceError, match="unstable coarse step") as fixed:
        mgrit.solve(prop, U0, 256, 0.0, 128.0, mgrit.Config(tol=0.0, **config))
    with pytest.raises(mgrit.DivergenceError) as checked:
        mgrit.solve(prop, U0, 256, 0.0, 128.0, mgrit.Config(tol=1e-300, **config))
    assert fixed.value.residuals == checked.value.residuals
    assert 2 <= len(fixed.value.residuals) < 12


def test_a_relative_tolerance_below_round_off_is_warned_about():
    """float32 cannot resolve a relative residual of 1e-9: the solve would run all its
    cycles without converging; float64 can."""
    cfg = mgrit.Config(levels=3, coarsening=4, tol=1e-9, tol_kind="relative", max_iter=4)
    with pytest.warns(RuntimeWarning, match=r"tol=1e-09 \(relative\) is below what "
                                            r"torch.float32 states resolve.*max_iter=4"):
        res = mgrit.solve(Dahlquist(-1.0), torch.tensor(1.0), 64, 0.0, 1.0, cfg)
    assert not res.converged and res.iterations == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mgrit.solve(Dahlquist(-1.0), U0, 64, 0.0, 1.0, cfg).converged


def test_capabilities_are_checked_once_per_class_and_attributes(monkeypatch):
    """mgrit.solve builds a solver per call: the signature and near-miss checks run for the
    first propagator of a class (and set of instance attributes) only; a non-callable
    optional attribute is refused every time."""
    from mgrit.core import propagator

    calls = []
    search = propagator.difflib.get_close_matches
    monkeypatch.setattr(propagator.difflib, "get_close_matches",
                        lambda *a, **k: calls.append(a[0]) or search(*a, **k))
    fresh = type("Fresh", (Dahlquist,), {})
    mgrit.Solver(fresh(), U0, 8, 0.0, 1.0)
    checked = len(calls)
    assert checked > 0
    mgrit.Solver(fresh(-2.0), U0, 8, 0.0, 1.0)
    assert len(calls) == checked
    odd = fresh()
    odd.extra = 1                                   # another set of attributes: checked again
    mgrit.Solver(odd, U0, 8, 0.0, 1.0)
    assert len(calls) > checked
    broken = fresh()
    broken.step_batch = 3
    with pytest.raises(TypeError, match="Fresh.step_batch is int, not a method"):
        mgrit.Solver(broken, U0, 8, 0.0, 1.0)
