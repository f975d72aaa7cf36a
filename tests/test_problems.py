"""Ready propagators against closed forms and dense linear algebra."""

import math

import pytest
import torch

import mgrit
from mgrit.problems import Dahlquist, DenseResNet, Heat1D
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
