"""Ready propagators against closed forms and dense linear algebra."""

import math

import pytest
import torch

import mgrit
from mgrit.problems import Dahlquist, DenseResNet, Heat1D
from mgrit.comm.virtual import run_ranks
from mgrit.core.propagator import StepBatch

from cases import heat_problem


def test_step_batch_records_match_single_steps():
    batch = StepBatch(level=2, start=3, stride=4, count=5, level_stride=16, t0=0.5, h=0.01)
    steps = list(batch)
    assert [s.index for s in steps] == batch.index.tolist() == [3, 7, 11, 15, 19]
    assert [s.fine_index for s in steps] == batch.fine_index.tolist()
    assert [s.t for s in steps] == batch.t.tolist()
    assert all(s.dt == batch.dt == 0.16 for s in steps)


@pytest.mark.parametrize("method,factor", [("backward_euler", lambda z: 1 / (1 - z)),
                                           ("forward_euler", lambda z: 1 + z)])
@pytest.mark.parametrize("lam", [-1.0, 2.5, -0.5 + 3j])
def test_dahlquist_steps_are_the_euler_factors(method, factor, lam):
    prop = Dahlquist(lam, method=method)
    dtype = torch.complex128 if isinstance(lam, complex) else torch.float64
    u = torch.tensor([1.0, -2.0], dtype=dtype)
    out = prop.step(u, mgrit.Step(0, 0, 0, 0.0, 0.1))
    assert torch.allclose(out, u * factor(0.1 * lam), rtol=1e-15, atol=0)
    # the march's in-place step: out = g + Phi(u), and Phi(u) alone without g
    g = torch.tensor([0.25, 3.0], dtype=dtype)
    into = torch.full_like(u, float("nan"))
    prop.step_into(u, mgrit.Step(0, 0, 0, 0.0, 0.1), into, g)
    assert torch.allclose(into, g + u * factor(0.1 * lam), rtol=1e-15, atol=0)
    prop.step_into(u, mgrit.Step(0, 0, 0, 0.0, 0.1), into, None)
    assert torch.allclose(into, out, rtol=1e-15, atol=0)


def test_dahlquist_rejects_unknown_method():
    with pytest.raises(ValueError, match="'backward_euler', 'forward_euler'"):
        Dahlquist(-1.0, method="rk4")


def _dense_heat_step(prop: Heat1D, u, t, dt):
    n = prop.nx - 2
    lap = (torch.diag(torch.full((n,), 2.0, dtype=torch.float64))
           - torch.diag(torch.ones(n - 1, dtype=torch.float64), 1)
           - torch.diag(torch.ones(n - 1, dtype=torch.float64), -1)) / prop.dx ** 2
    matrix = torch.eye(n, dtype=torch.float64) + dt * prop.a * lap
    rhs = u + dt * prop.forcing(prop.x, torch.tensor(t + dt, dtype=torch.float64))
    return torch.linalg.solve(matrix, rhs)


def test_heat_step_is_backward_euler_with_end_time_forcing():
    prop, u0 = heat_problem(41, a=0.7)
    s = mgrit.Step(0, 3, 3, 0.3, 0.05)
    assert torch.allclose(prop.step(u0, s), _dense_heat_step(prop, u0, 0.3, 0.05),
                          rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("forcing", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.complex128])
def test_heat_batched_equals_single_steps(forcing, dtype):
    prop, _ = heat_problem(21)
    if not forcing:
        prop.forcing = None
    states = torch.randn(6, 19, generator=torch.Generator().manual_seed(1),
                         dtype=torch.float64).to(dtype)
    batch = StepBatch(level=1, start=2, stride=3, count=6, level_stride=4, t0=0.0, h=0.01)
    out = prop.step_batch(states, batch)
    ref = torch.stack([prop.step(states[i], s) for i, s in enumerate(batch)])
    assert out.dtype == dtype
    assert torch.equal(out, ref)


def test_heat_rejects_bad_grid():
    with pytest.raises(ValueError, match="nx must be an int >= 3"):
        Heat1D(2)
    with pytest.raises(ValueError, match="a must be > 0"):
        Heat1D(10, a=0.0)


def test_resnet_step_formula_and_batched_agree():
    prop = DenseResNet.random(10, 5, seed=2)
    u = torch.randn(4, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    s = mgrit.Step(1, 2, 4, 0.4, 0.2)
    expected = u + 0.2 * torch.tanh(u @ prop.weights[4].T + prop.biases[4])
    assert torch.allclose(prop.step(u, s), expected, rtol=1e-15, atol=1e-15)
    batch = StepBatch(level=1, start=0, stride=2, count=3, level_stride=2, t0=0.0, h=0.1)
    states = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out = prop.step_batch(states, batch)
    ref = torch.stack([prop.step(states[i], s) for i, s in enumerate(batch)])
    assert torch.allclose(out, ref, rtol=1e-14, atol=1e-15)


def test_resnet_rejects_mismatched_parameters():
    with pytest.raises(ValueError, match=r"weights must have shape \(N, d, d\)"):
        DenseResNet(torch.zeros(4, 3, 2), torch.zeros(4, 3))
    with pytest.raises(ValueError, match="biases must have shape"):
        DenseResNet(torch.zeros(4, 3, 3), torch.zeros(4, 2))


def test_heat_solution_converges_to_the_pde_solution_at_first_order_in_time():
    errors = []
    for n in (32, 64, 128):
        prop, u0 = heat_problem(257)
        final = mgrit.step_sequentially(prop, u0, n, 0.0, 1.0)[-1]
        errors.append(float((final - torch.sin(math.pi * prop.x) * math.cos(1.0)).abs().max()))
    orders = [math.log2(errors[i] / errors[i + 1]) for i in range(2)]
    assert all(0.85 < p < 1.15 for p in orders), orders


class _SteppedDahlquist(Dahlquist):
    """Dahlquist without compiled marches: every step of a march is a call of its own."""

    step_program = None
    program_key = None


def _counted(prop: Dahlquist) -> list[int]:
    """Count the propagator's single steps into a list of one."""
    calls = [0]
    step_into = prop.step_into

    def counting(u, s, out, g):
        calls[0] += 1
        step_into(u, s, out, g)

    prop.step_into = counting
    return calls


@pytest.mark.parametrize("method", ["backward_euler", "forward_euler"])
@pytest.mark.parametrize("forcing", [True, False])
def test_dahlquist_compiled_march_is_the_step_by_step_march_to_the_bit(method, forcing):
    """A compiled march (a real float64 scalar) against `step_into` one step at a time:
    random states, forcing and step sizes, each step reading what the one before wrote."""
    g = torch.Generator().manual_seed(7)
    prop = Dahlquist(-1.7, method=method)
    n = 23
    u = torch.randn(n + 1, dtype=torch.float64, generator=g)
    rhs = torch.randn(n + 1, dtype=torch.float64, generator=g) if forcing else None
    steps = [mgrit.Step(2, k, 4 * k, 0.1 * k, float(dt))
             for k, dt in enumerate(torch.rand(n, generator=g, dtype=torch.float64) * 0.3)]
    rows = [(u[k], u[k + 1], None if rhs is None else rhs[k + 1]) for k in range(n)]
    expected = u.clone()
    for k, s in enumerate(steps):
        prop.step_into(expected[k], s, expected[k + 1], None if rhs is None else rhs[k + 1])
    program = prop.step_program(steps, rows, 1)
    assert program is not None
    program()
    assert torch.equal(u, expected)
    program()                      # a program runs again on what its rows hold now
    for k, s in enumerate(steps):
        prop.step_into(expected[k], s, expected[k + 1], None if rhs is None else rhs[k + 1])
    assert torch.equal(u, expected)


def test_dahlquist_compiles_no_other_phase():
    """Batched phases, other dtypes, complex factors, vector states, rows that do not chain
    or not evenly spaced, and forcing on some steps only run step by step."""
    s = mgrit.Step(0, 0, 0, 0.0, 0.1)
    u = torch.zeros(5, dtype=torch.float64)
    chain = [(u[k], u[k + 1], None) for k in range(4)]
    real = Dahlquist(-1.0)
    assert real.program_key(1, 4) is None and real.program_key(3, 1) is not None
    assert real.program_key(0, 1) is None           # level 0 marches once per cycle at most
    assert real.step_program([s] * 4, chain, 4) is None
    assert real.step_program([s] * 4, chain, 1) is not None
    u32 = u.float()
    assert real.step_program([s] * 4, [(u32[k], u32[k + 1], None) for k in range(4)], 1) is None
    c = torch.zeros(5, dtype=torch.complex128)
    assert Dahlquist(-1 + 2j).step_program([s] * 4, [(c[k], c[k + 1], None)
                                                     for k in range(4)], 1) is None
    v = torch.zeros(5, 2, dtype=torch.float64)
    assert real.step_program([s] * 4, [(v[k], v[k + 1], None) for k in range(4)], 1) is None
    apart = [(u[0], u[1], None), (u[2], u[3], None)]                 # u[1] is not read
    assert real.step_program([s] * 2, apart, 1) is None
    w = torch.zeros(8, dtype=torch.float64)
    uneven = [(w[0], w[1], None), (w[1], w[3], None)]
    assert real.step_program([s] * 2, uneven, 1) is None
    g = torch.ones(5, dtype=torch.float64)
    partly = [(u[0], u[1], g[1]), (u[1], u[2], None)]
    assert real.step_program([s] * 2, partly, 1) is None


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("config", [
    mgrit.Config(levels=5, coarsening=4, relax="FCF", tol=1e-10, max_iter=30),
    mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), cycle="F", tol=0.0, max_iter=4,
                 min_coarse=1),
], ids=["W0-like", "F-cycle"])
def test_dahlquist_solves_with_compiled_marches_give_the_step_by_step_bits(ranks, config):
    """Whole solves of a float64 scalar on 1-3 ranks: the same residuals, states and final
    value as with every march step by step, and the coarse levels' marches did run compiled
    (fewer single steps are taken)."""
    num_steps = 1000

    def program(comm, cls):
        prop = cls(-1.0)
        calls = _counted(prop)
        res = mgrit.solve(prop, torch.tensor(1.0, dtype=torch.float64), num_steps, 0.0, 50.0,
                          config, comm=comm)
        return res.residuals, res.states.clone(), res.final.clone(), calls[0]

    compiled = run_ranks(ranks, lambda comm: program(comm, Dahlquist))
    stepped = run_ranks(ranks, lambda comm: program(comm, _SteppedDahlquist))
    for (r1, s1, f1, n1), (r2, s2, f2, n2) in zip(compiled, stepped):
        assert r1 == r2
        assert torch.equal(s1, s2) and torch.equal(f1, f2)
        assert n2 > 0 and n1 < n2
