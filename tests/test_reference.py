"""The solver against two independent MGRIT implementations, number by number.

1. `reference_mgrit`: a slow, list-based restatement of docs/design.md section 2 ("The
   algorithm") written separately from the package, run with the very same step functions,
   so histories must agree to round-off for every option (C-weights, per-level settings,
   guesses).
2. PyMGRIT 1.0.6, an established MGRIT library, on its own Dahlquist and heat problems.
"""

import itertools

import numpy as np
import pytest
import torch

import mgrit
from mgrit.problems import Dahlquist

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
