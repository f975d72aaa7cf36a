"""The solver against two independent MGRIT implementations, number by number.

1. `reference_mgrit`: a slow, list-based restatement of docs/design.md section 2 ("The
   algorithm") written separately from the package, run with the very same step functions,
   so histories must agree to round-off for every option (C-weights, per-level settings,
   guesses).
2. PyMGRIT 1.0.6, an established MGRIT library, on its own Dahlquist and heat problems, and
   on two nonlinear problems written here for both (a driven pendulum and a tanh residual
   network), where its FAS cycle is exercised in earnest: there residual histories and the
   states at every point must agree to round-off, and both must reach sequential stepping.
"""

import copy
import functools
import itertools
import math

import numpy as np
import pytest
import torch

import mgrit
from mgrit.problems import Dahlquist, DenseResNet

from cases import heat_problem, resnet_problem
from needs import require
from reference_mgrit import reference_mgrit


def _numpy_step(prop, strides):
    """The propagator's step as the reference calls it: numpy in, numpy out."""
    def step(u, level, index, t, dt):
        s = mgrit.Step(level, index, index * strides[level], t, dt)
        return prop.step(torch.from_numpy(np.array(u)), s).numpy()
    return step


PROBLEMS = {
    "dahlquist-real": lambda: (Dahlquist(-1.0), torch.tensor([1.0, -0.5], dtype=torch.float64),
                               1030, 20.0),
    "dahlquist-complex": lambda: (Dahlquist(-0.2 + 3j), torch.tensor([1.0 + 1j], dtype=torch.complex128),
                                  257, 8.0),
    "heat": lambda: (*heat_problem(17), 130, 1.0),
    "resnet": lambda: (*resnet_problem(num_steps=75), 75, 1.0),
}

SETTINGS = [
    # levels, coarsening, relax (per level or one), relax_sweeps, cycle, guess, c_weight
    (2, 8, "F", 1, "V", "zero", 1.0),
    (2, 4, "FCF", 2, "V", "nested", 0.7),
    (3, 2, "FCF", 1, "F", "zero", 1.3),
    (3, 3, "F", 1, "F", "nested", 1.0),
    (4, [2, 4, 2], ["F", "FCF", "F"], 1, "V", "zero", 1.0),
    (4, 2, "FCF", 1, "F", "tensor", 0.8),
    (5, 2, "F", 1, "V", "nested", 1.0),
    (5, [4, 2, 2, 2], "FCF", 2, "F", "zero", 1.0),
]


@pytest.mark.parametrize("name", sorted(PROBLEMS))
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(map(str, s)).replace(" ", ""))
def test_histories_equal_the_independent_reference(name, setting):
    prop, u0, n, t1 = PROBLEMS[name]()
    levels, m, relax, sweeps, cycle, guess, w = setting
    if guess == "tensor":
        gen = torch.Generator().manual_seed(3)
        guess = torch.randn((n + 1, *u0.shape), generator=gen, dtype=torch.float64).to(u0.dtype)
    cfg = mgrit.Config(levels=levels, coarsening=m, relax=relax, relax_sweeps=sweeps,
                       cycle=cycle, initial_guess=guess, c_weight=w, tol=0.0, max_iter=6,
                       min_coarse=1)
    res = mgrit.solve(prop, u0, n, 0.0, t1, cfg)
    strides = [1]
    for l in range(levels - 1):
        strides.append(strides[-1] * cfg.coarsening_at(l))
    ref_res, ref_states = reference_mgrit(
        _numpy_step(prop, strides), u0.numpy(), n, 0.0, t1, levels=levels,
        coarsening=list(cfg.coarsening_list()),
        cf_sweeps=[cfg.cf_sweeps_at(l) for l in range(max(levels - 1, 1))] + [0],
        c_weight=w, cycle=cycle,
        initial_guess=guess.numpy() if isinstance(guess, torch.Tensor) else guess,
        max_iter=6, tol=0.0, min_coarse=1)
    assert len(res.residuals) == len(ref_res)
    for a, b in zip(res.residuals, ref_res):
        assert abs(a - b) <= 1e-12 * abs(b) + 1e-15
    assert np.abs(res.states.numpy() - ref_states).max() <= 1e-12 * np.abs(ref_states).max()


@pytest.mark.parametrize("name", sorted(PROBLEMS))
@pytest.mark.parametrize("levels,m", [(2, 8), (3, 3), (5, 2)])
def test_no_cycle_from_a_nested_start_equals_the_independent_reference(name, levels, m):
    """max_iter=0: the nested start F-relaxed once, one residual, as the reference does."""
    prop, u0, n, t1 = PROBLEMS[name]()
    cfg = mgrit.Config(levels=levels, coarsening=m, relax="F", initial_guess="nested",
                       tol=0.0, max_iter=0, min_coarse=1)
    res = mgrit.solve(prop, u0, n, 0.0, t1, cfg)
    strides = [m ** l for l in range(levels)]
    ref_res, ref_states = reference_mgrit(
        _numpy_step(prop, strides), u0.numpy(), n, 0.0, t1, levels=levels,
        coarsening=[m] * (levels - 1), cf_sweeps=[0] * levels, c_weight=1.0, cycle="V",
        initial_guess="nested", max_iter=0, tol=0.0, min_coarse=1)
    assert len(res.residuals) == len(ref_res) == 1
    assert abs(res.residuals[0] - ref_res[0]) <= 1e-12 * abs(ref_res[0]) + 1e-15
    assert np.abs(res.states.numpy() - ref_states).max() <= 1e-12 * np.abs(ref_states).max()
    # the C-points hold the coarse solution: not yet the sequential one
    exact = mgrit.solve(prop, u0, n, 0.0, t1, mgrit.Config(levels=1, max_iter=1, tol=0.0))
    assert not torch.allclose(res.states, exact.states, rtol=1e-9, atol=0.0)


def test_no_cycle_on_layers_too_few_for_a_coarse_level_is_one_sweep():
    """Where the layers give a single level (6 steps, min_coarse 4), no cycle is not no
    work: the solve is sequential stepping's one sweep."""
    u0 = torch.tensor([1.0, -0.5], dtype=torch.float64)
    cfg = mgrit.Config(levels=3, coarsening=8, relax="F", initial_guess="nested", tol=0.0,
                       max_iter=0, min_coarse=4)
    res = mgrit.solve(Dahlquist(-1.0), u0, 6, 0.0, 1.0, cfg)
    exact = mgrit.solve(Dahlquist(-1.0), u0, 6, 0.0, 1.0,
                        mgrit.Config(levels=1, max_iter=1, tol=0.0))
    assert res.levels == 1 and torch.equal(res.states, exact.states)


def test_no_cycle_needs_a_nested_start():
    for options in ({"initial_guess": "zero"}, {"levels": 1}, {"tol": 1e-6},
                    {"initial_guess": "warm"}):
        with pytest.raises(ValueError, match="max_iter=0"):
            mgrit.Config(**{"levels": 2, "initial_guess": "nested", "tol": 0.0, **options,
                            "max_iter": 0})
    with pytest.raises(ValueError, match="max_iter must be >= 0"):
        mgrit.Config(max_iter=-1)


# ---------------------------------------------------------------------------------------------
# PyMGRIT

def _pymgrit():
    require("pymgrit", "the comparison with an established MGRIT library")
    np.in1d = getattr(np, "in1d", np.isin)  # PyMGRIT 1.0.6 predates numpy 2.4's removal of in1d
    from pymgrit.core.mgrit import Mgrit
    from pymgrit.core.simple_setup_problem import simple_setup_problem
    from pymgrit.dahlquist.dahlquist import Dahlquist as PyDahlquist
    from pymgrit.heat.heat_1d import Heat1D as PyHeat1D
    return Mgrit, simple_setup_problem, PyDahlquist, PyHeat1D


def _pymgrit_history(problem, n, t1, levels, m, cf, cycle, nested, weight, nx=17):
    Mgrit, setup, PyDahlquist, PyHeat1D = _pymgrit()
    if problem == "dahlquist":
        app = PyDahlquist(t_start=0, t_stop=t1, nt=n + 1, method="BE", constant_lambda=-1.0)
    else:
        app = PyHeat1D(x_start=0, x_end=1, nx=nx, a=1.0, init_cond=lambda x: np.sin(np.pi * x),
                       rhs=lambda x, t: -np.sin(np.pi * x) * (np.sin(t) - np.pi ** 2 * np.cos(t)),
                       t_start=0, t_stop=t1, nt=n + 1)
    solver = Mgrit(problem=setup(problem=app, level=levels, coarsening=m), max_iter=7, tol=1e-300,
                   cf_iter=cf, cycle_type=cycle, nested_iteration=nested, weight_c=weight,
                   logging_lvl=30)
    return [float(r) for r in solver.solve()["conv"]]


PYMGRIT_CASES = [
    ("dahlquist", levels, m, cf, cycle, nested, weight)
    for (levels, m), cf, cycle, nested in itertools.product(
        [(2, 4), (3, 2), (4, 4), (5, 2)], [0, 1], ["V", "F"], [False, True])
    for weight in ([1.0, 0.7] if cf else [1.0])
] + [
    ("heat", levels, m, cf, cycle, nested, 1.0)
    for (levels, m), cf, cycle, nested in itertools.product(
        [(2, 4), (4, 2)], [0, 1], ["V", "F"], [False, True])
]


@pytest.mark.slow
@pytest.mark.parametrize("problem,levels,m,cf,cycle,nested,weight", PYMGRIT_CASES)
def test_histories_equal_pymgrit(problem, levels, m, cf, cycle, nested, weight):
    n, t1 = (1024, 50.0) if problem == "dahlquist" else (128, 2.0)
    expected = _pymgrit_history(problem, n, t1, levels, m, cf, cycle, nested, weight)
    if problem == "dahlquist":
        prop, u0 = Dahlquist(-1.0), torch.tensor(1.0, dtype=torch.float64)
    else:
        prop, u0 = heat_problem(17)
    cfg = mgrit.Config(levels=levels, coarsening=m, relax="FCF" if cf else "F", relax_sweeps=max(cf, 1),
                       cycle=cycle, initial_guess="nested" if nested else "zero", c_weight=weight,
                       tol=0.0, max_iter=7, min_coarse=1)
    got = mgrit.solve(prop, u0, n, 0.0, t1, cfg).residuals
    assert len(got) == len(expected)
    # PyMGRIT's step lengths come from np.linspace and differ from h*m^l in the last bit,
    # and its sparse solver rounds differently: agreement to 1e-9, or to 1e-13 absolute
    # once the residual nears round-off.
    for a, b in zip(got, expected):
        assert abs(a - b) <= 1e-9 * abs(b) + 1e-13, (got, expected)


# ---------------------------------------------------------------------------------------------
# PyMGRIT on nonlinear problems
#
# For a linear Phi, FAS (coarse right-hand side g = r + v - Phi_c(v), correction u_c - v) and
# the linear correction scheme (the coarse level solves for the error, e_j = r_j + Phi_c(e_{j-1}))
# are one algorithm, so the comparisons above cannot tell them apart; here the steps are
# nonlinear. Both solvers see the same times to the bit: the step lengths (3/64, 1/128) are
# short binary fractions, so PyMGRIT's np.linspace times, their differences and mgrit's
# t0 + n h and h m^l are all exact.

EPS = float(np.finfo(np.float64).eps)


@functools.cache
def _pymgrit_arrays():
    """PyMGRIT's Vector and Application for a state held in a numpy array and advanced by a
    function `step(u, t_start, t_stop)`. Built on first use: PyMGRIT is optional (`require`)."""
    _pymgrit()
    from pymgrit.core.application import Application
    from pymgrit.core.vector import Vector

    class ArrayVector(Vector):
        def __init__(self, values):
            super().__init__()
            self.values = values

        def __add__(self, other):
            return ArrayVector(self.values + other.values)

        def __sub__(self, other):
            return ArrayVector(self.values - other.values)

        def __mul__(self, other):
            return ArrayVector(self.values * other)

        def norm(self):
            return np.linalg.norm(self.values)

        def clone(self):
            return ArrayVector(self.values.copy())

        def clone_zero(self):
            return ArrayVector(np.zeros_like(self.values))

        def clone_rand(self):
            return ArrayVector(np.random.default_rng(0).random(self.values.shape))

        def set_values(self, values):
            self.values = values

        def get_values(self):
            return self.values

        def pack(self):
            return self.values

        def unpack(self, values):
            self.values = values

    class ArrayApplication(Application):
        def __init__(self, step, u0, t_start, t_stop, nt):
            super().__init__(t_start=t_start, t_stop=t_stop, nt=nt)
            self.advance = step
            self.vector_template = ArrayVector(np.zeros_like(u0))
            self.vector_t_start = ArrayVector(u0.copy())

        def step(self, u_start, t_start, t_stop):
            return ArrayVector(self.advance(u_start.values, t_start, t_stop))

    return ArrayVector, ArrayApplication


def _pymgrit_levels(app, coarsening):
    """PyMGRIT's hierarchy with a coarsening factor per level (its simple_setup_problem takes
    one for all): each level a copy of the finer one on every m-th of its time points."""
    levels = [app]
    for m in coarsening:
        coarse = copy.deepcopy(levels[-1])
        coarse.t = levels[-1].t[::m]
        coarse.t_start, coarse.t_end, coarse.nt = coarse.t[0], coarse.t[-1], len(coarse.t)
        levels.append(coarse)
    return levels


def _pymgrit_solve(step, u0, n, t1, coarsening, cf, cycle, nested, weight, cycles):
    """PyMGRIT's residual history and its level-0 states at all n + 1 points."""
    Mgrit = _pymgrit()[0]
    _, ArrayApplication = _pymgrit_arrays()
    app = ArrayApplication(step, u0, t_start=0.0, t_stop=t1, nt=n + 1)
    solver = Mgrit(problem=_pymgrit_levels(app, coarsening), max_iter=cycles, tol=1e-300,
                   cf_iter=cf, cycle_type=cycle, nested_iteration=nested, weight_c=weight,
                   logging_lvl=30)
    history = [float(r) for r in solver.solve()["conv"]]
    return history, np.stack([v.values for v in solver.u[0]])


def _sequential(step, u0, n, t1):
    """Plain time stepping with PyMGRIT's step function: the reference both solvers reach."""
    t = np.linspace(0.0, t1, n + 1)
    states = [u0]
    for i in range(n):
        states.append(step(states[-1], t[i], t[i + 1]))
    return np.stack(states)


def _compare_with_pymgrit(prop, step, u0, n, t1, coarsening, cf, cycle, nested, weight,
                          cycles, execution="auto"):
    """Run both solvers for `cycles` cycles and check histories, states and convergence."""
    expected, expected_states = _pymgrit_solve(step, u0, n, t1, coarsening, cf, cycle, nested,
                                               weight, cycles)
    cfg = mgrit.Config(levels=len(coarsening) + 1, coarsening=list(coarsening),
                       relax="FCF" if cf else "F", relax_sweeps=max(cf, 1), cycle=cycle,
                       initial_guess="nested" if nested else "zero", c_weight=weight, tol=0.0,
                       max_iter=cycles, min_coarse=1, execution=execution)
    res = mgrit.solve(prop, torch.from_numpy(u0), n, 0.0, t1, cfg)
    got, states = res.residuals, res.states.numpy()
    sequential = _sequential(step, u0, n, t1)
    # The two solvers do the same operations, but not necessarily in the same order, nor
    # with the same kernels (the network's products and tanh differ in the last bit between
    # torch and numpy): a rounding per step, carried to the end, bounds how far the states
    # may drift apart, and so how far the residuals (differences of states) may too. The
    # norms themselves are summed in different orders: a few eps relative.
    round_off = n * EPS * np.abs(sequential).max()
    assert len(got) == len(expected) == cycles, (got, expected)
    for a, b in zip(got, expected):
        assert abs(a - b) <= 100 * EPS * b + round_off, (got, expected)
    assert np.abs(states - expected_states).max() <= round_off
    # Sequential stepping solves u_j = Phi(u_{j-1}) exactly; the solvers' error is their
    # C-point residuals carried forward by the linearised steps. Both problems are damped, so
    # these carry them without much growth, and the error stays below the residuals' sum,
    # at most sqrt(number of C-points) times their norm. Every case converges far enough in
    # its cycles for this to be a real check.
    assert got[-1] <= 1e-7, got
    bound = math.sqrt(n // coarsening[0]) * got[-1] + round_off
    assert np.abs(states - sequential).max() <= bound


# The damped, periodically driven pendulum x'' = -sin(x) - d x' + a cos(w t), by forward Euler.
DAMPING, DRIVE, FREQUENCY = 0.5, 1.2, 2 / 3


def _pendulum_step(u, t_start, t_stop):
    """One forward Euler step of the driven pendulum, state (x, x'), in numpy."""
    dt = t_stop - t_start
    x, v = u
    accel = DRIVE * np.cos(FREQUENCY * t_start) - DAMPING * v - np.sin(x)
    return np.array([x + dt * v, v + dt * accel])


class Pendulum:
    """The driven pendulum as an mgrit propagator: the very step PyMGRIT takes, so that the
    comparison is of the two solvers alone."""

    def step(self, u, s):
        return torch.from_numpy(_pendulum_step(u.numpy(), s.t, s.t + s.dt))


class NetworkSteps:
    """u + dt tanh(W_n u + b_n) with the layer n of the fine step where [t_start, t_stop]
    begins: mgrit's rule for network steps ("coarse steps use the layer where they start"),
    stated again from PyMGRIT's times and written in numpy, not through DenseResNet."""

    def __init__(self, weights, biases, t0, h):
        self.weights, self.biases, self.t0, self.h = weights, biases, t0, h

    def __call__(self, u, t_start, t_stop):
        n = round((t_start - self.t0) / self.h)
        return u + (t_stop - t_start) * np.tanh(u @ self.weights[n].T + self.biases[n])


NONLINEAR_CASES = [
    # coarsening per level, cf_iter (0: F-relaxation), cycle, nested, C-weight
    ([4], 0, "V", False, 1.0),
    ([4], 1, "F", True, 0.7),
    ([4, 4], 0, "V", True, 1.0),
    ([4, 4], 1, "F", False, 1.0),
    ([2, 4, 2], 2, "V", False, 1.3),
    ([4, 2, 2], 1, "V", True, 0.8),
    ([2, 2, 2, 2], 0, "F", False, 1.0),
    ([2, 2, 2, 2], 1, "F", True, 1.0),
]
_ids = ["-".join(map(str, c)).replace(" ", "") for c in NONLINEAR_CASES]


@pytest.mark.slow
@pytest.mark.parametrize("coarsening,cf,cycle,nested,weight", NONLINEAR_CASES, ids=_ids)
def test_pendulum_equals_pymgrit(coarsening, cf, cycle, nested, weight):
    """A nonlinear ODE system whose pendulum swings over the top (|x| reaches 4.3)."""
    u0 = np.array([1.0, 0.0])
    _compare_with_pymgrit(Pendulum(), _pendulum_step, u0, 256, 12.0, coarsening, cf, cycle,
                          nested, weight, cycles=12)


@pytest.mark.slow
@pytest.mark.parametrize("execution", ["auto", "loop"])
@pytest.mark.parametrize("coarsening,cf,cycle,nested,weight", NONLINEAR_CASES, ids=_ids)
def test_tanh_network_equals_pymgrit(coarsening, cf, cycle, nested, weight, execution):
    """A residual network's forward pass, width 6, a batch of 3, weights large enough
    (scale 3) for tanh to saturate; mgrit's batched and looped executors alike."""
    n, t1 = 128, 1.0
    prop = DenseResNet.random(n, 6, scale=3.0, seed=2)
    u0 = torch.randn(3, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    step = NetworkSteps(prop.weights.numpy(), prop.biases.numpy(), 0.0, t1 / n)
    _compare_with_pymgrit(prop, step, u0.numpy(), n, t1, coarsening, cf, cycle, nested,
                          weight, cycles=12, execution=execution)
