"""The serial solver against independent references: sequential stepping, theory, published histories."""

import math

import pytest
import torch

import mgrit
from mgrit.core.propagator import Capabilities, StepBatch
from mgrit.execute import make_executor
from mgrit.problems import Dahlquist, DenseResNet

from benchmarks.workloads import W0_REFERENCE

from cases import heat_problem, relative_error, resnet_problem


PROBLEMS = {
    "dahlquist": lambda: (Dahlquist(-1.0), torch.tensor(1.0, dtype=torch.float64), 64, 4.0),
    "heat": lambda: (*heat_problem(17), 64, 1.0),
    "resnet": lambda: (*resnet_problem(), 64, 1.0),
}


def test_w0_reproduces_the_established_history():
    res = mgrit.solve(Dahlquist(-1.0), torch.tensor(1.0, dtype=torch.float64), 16384, 0.0, 819.2,
                      mgrit.Config(levels=5, coarsening=4, relax="FCF", cycle="V", tol=1e-10,
                                   initial_guess="zero"))
    assert res.converged and res.iterations == 10 and res.levels == 5
    assert len(res.residuals) == len(W0_REFERENCE)
    for got, ref in zip(res.residuals, W0_REFERENCE):
        assert got == pytest.approx(ref, rel=1e-8)


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_one_level_is_sequential_stepping_exactly(name):
    prop, u0, n, t1 = PROBLEMS[name]()
    res = mgrit.solve(prop, u0, n, 0.0, t1, mgrit.Config(levels=1))
    seq = mgrit.step_sequentially(prop, u0, n, 0.0, t1)
    assert torch.equal(res.states, seq)
    assert torch.equal(res.final, seq[-1])
    assert res.converged and res.iterations == 1 and res.residuals == [0.0]


@pytest.mark.parametrize("levels,m,cycle", [(2, 2, "V"), (2, 4, "V"), (2, 8, "V"), (3, 2, "V"),
                                            (3, 4, "F"), (4, 2, "F"), (4, 4, "V")])
def test_f_relaxation_makes_k_intervals_exact_after_k_cycles(levels, m, cycle):
    prop, u0 = resnet_problem(num_steps=64)
    seq = mgrit.step_sequentially(prop, u0, 64, 0.0, 1.0)
    scale = float(seq.abs().max())
    needed = math.ceil(64 / m)
    for k in range(1, needed + 1):
        res = mgrit.solve(prop, u0, 64, 0.0, 1.0,
                          mgrit.Config(levels=levels, coarsening=m, relax="F", cycle=cycle, tol=0.0,
                                       max_iter=k, min_coarse=1))
        err = (res.states - seq).abs().flatten(1).amax(dim=1)
        assert float(err[: k * m + 1].max()) <= 1e-13 * scale, f"after {k} cycles"
    assert float((res.states - seq).abs().max()) <= 1e-13 * scale


def _two_level_bound(prop, m, n_coarse, relax):
    lam_f = prop.amplification(1.0)
    mu = prop.amplification(float(m))
    diff = abs(lam_f ** m - mu)
    amu = abs(mu)
    if relax == "F":
        return diff * (1 - amu ** (n_coarse - 1)) / (1 - amu)
    return abs(lam_f) ** m * diff * (1 - amu ** (n_coarse - 2)) / (1 - amu)


@pytest.mark.parametrize("z", [-2.0, -1.0, -0.5, -0.2, -0.05, 0.1j, 0.5j, 1j, 2j, -0.5 + 1j])
@pytest.mark.parametrize("m", [2, 4, 8])
@pytest.mark.parametrize("relax", ["F", "FCF"])
def test_two_level_convergence_within_theory_bound(z, m, relax):
    """Dobrev et al. (2017): residual ratios of two-level MGRIT for u' = lam u, h = 1, lam*h = z."""
    n = 128
    prop = Dahlquist(z)
    dtype = torch.complex128 if isinstance(z, complex) else torch.float64
    guess = torch.rand(n + 1, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    res = mgrit.solve(prop, torch.ones((), dtype=dtype), n, 0.0, float(n),
                      mgrit.Config(levels=2, coarsening=m, relax=relax, tol=0.0, max_iter=12,
                                   initial_guess=guess.to(dtype)))
    bound = _two_level_bound(prop, m, n // m, relax)
    r = res.residuals
    ratios = [r[k + 1] / r[k] for k in range(len(r) - 1) if r[k + 1] > 1e-13]
    assert ratios, "the history reached round-off before a ratio could be measured"
    assert max(ratios) <= bound * (1 + 1e-9), (max(ratios), bound)


def test_heat_converged_equals_sequential_backward_euler():
    prop, u0 = heat_problem(65)
    seq = mgrit.step_sequentially(prop, u0, 512, 0.0, 2.0)
    res = mgrit.solve(prop, u0, 512, 0.0, 2.0,
                      mgrit.Config(levels=4, coarsening=2, relax="FCF", tol=1e-13, max_iter=40))
    assert res.converged
    assert relative_error(res.states, seq) <= 1e-10
    # and the time stepping itself is right: close to the exact sin(pi x) cos(t)
    exact = torch.sin(math.pi * prop.x) * math.cos(2.0)
    assert float((res.final - exact).abs().max()) < 1e-3


@pytest.mark.parametrize("relax,cycle", [("FCF", "V"), ("FCF", "F"), ("F", "F")])
@pytest.mark.parametrize("levels", [3, 4, 5, 6])
def test_heat_multilevel_convergence_factor_below_quarter(cycle, levels, relax):
    """Scalable settings stay fast as levels are added. (F-relaxation with V-cycles does not:
    its factor grows with the number of levels, as MGRIT theory predicts.)"""
    prop, u0 = heat_problem(33)
    res = mgrit.solve(prop, u0, 256, 0.0, 2.0,
                      mgrit.Config(levels=levels, coarsening=2, relax=relax, cycle=cycle,
                                   tol=1e-11, max_iter=30))
    assert res.converged
    r = res.residuals
    factors = [r[k + 1] / r[k] for k in range(len(r) - 1)]
    assert max(factors) < 0.25, factors


@pytest.mark.parametrize("name", sorted(PROBLEMS))
@pytest.mark.parametrize("cycle,relax,guess", [("V", "FCF", "zero"), ("F", "F", "nested"),
                                               ("V", "F", "nested"), ("F", "FCF", "zero")])
def test_loop_and_batched_relaxation_agree(name, cycle, relax, guess):
    prop, u0, n, t1 = PROBLEMS[name]()
    runs = {}
    for execution in ("loop", "batched"):
        cfg = mgrit.Config(levels=3, coarsening=4, relax=relax, cycle=cycle, initial_guess=guess,
                           tol=0.0, max_iter=4, min_coarse=1, execution=execution)
        runs[execution] = mgrit.solve(prop, u0, n, 0.0, t1, cfg)
    loop, batched = runs["loop"], runs["batched"]
    scale = loop.residuals[0]
    assert len(loop.residuals) == len(batched.residuals) > 0
    for a, b in zip(loop.residuals, batched.residuals):
        assert abs(a - b) <= 1e-12 * max(abs(a), 1e-3 * scale)
    assert relative_error(batched.states, loop.states) <= 1e-12


def test_a_batch_of_one_interval_takes_the_single_step_path():
    """The batched executor hands a batch of one to `step_into` (a batch's overhead for one
    step's work is what a rank holding one coarse interval would pay), larger batches to
    `step_batch`; both give the propagator's steps."""
    net = DenseResNet.random(16, 5, seed=4)
    calls = []

    class Counting:
        def step(self, u, s):
            return net.step(u, s)

        def step_batch(self, states, steps):
            calls.append(("batch", len(steps)))
            return net.step_batch(states, steps)

        def step_into(self, u, s, out, g):
            calls.append(("single", s.index))
            out.copy_(net.step(u, s) if g is None else g + net.step(u, s))

    executor = make_executor("batched", Capabilities.of(Counting()))
    states = torch.randn(3, 2, 5, generator=torch.Generator().manual_seed(5),
                         dtype=torch.float64)
    g = torch.randn_like(states)
    for count in (1, 3):
        steps = StepBatch(level=1, start=1, stride=2, count=count, level_stride=2, t0=0.0,
                          h=1 / 16)
        expected = torch.stack([net.step(states[i], s) for i, s in enumerate(steps)])
        calls.clear()
        out = torch.empty_like(states[:count])
        executor.advance_into(states[:count], steps, out, g[:count])
        assert torch.allclose(out, g[:count] + expected, rtol=1e-14, atol=1e-15)
        assert torch.allclose(executor.advance(states[:count], steps), expected,
                              rtol=1e-14, atol=1e-15)
        assert calls == ([("single", 1)] * 2 if count == 1 else [("batch", 3)] * 2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_real_dtypes_are_kept_and_converge(dtype, tol):
    prop = DenseResNet.random(128, 8, seed=3, dtype=dtype)
    u0 = torch.randn(2, 8, generator=torch.Generator().manual_seed(0), dtype=dtype)
    res = mgrit.solve(prop, u0, 128, 0.0, 1.0,
                      mgrit.Config(levels=3, coarsening=4, tol=tol * 1e-2, max_iter=20))
    assert res.states.dtype == dtype and res.final.dtype == dtype
    seq = mgrit.step_sequentially(prop, u0, 128, 0.0, 1.0)
    assert relative_error(res.states, seq) <= tol


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_states(dtype):
    prop = Dahlquist(-0.3 + 2.0j)
    u0 = torch.tensor([1.0 + 0.5j, -0.25j], dtype=dtype)
    res = mgrit.solve(prop, u0, 200, 0.0, 10.0,
                      mgrit.Config(levels=3, coarsening=2, tol=1e-12, max_iter=40, min_coarse=1))
    assert res.states.dtype == dtype
    seq = mgrit.step_sequentially(prop, u0, 200, 0.0, 10.0)
    tol = 1e-5 if dtype == torch.complex64 else 1e-11
    assert relative_error(res.states, seq) <= tol


def test_heat_keeps_float32():
    prop, u0 = heat_problem(17)
    u0 = u0.float()
    res = mgrit.solve(prop, u0, 64, 0.0, 1.0, mgrit.Config(levels=3, tol=1e-6, max_iter=20))
    assert res.final.dtype == torch.float32 and res.converged


def test_relative_tolerance_is_relative_to_the_initial_residual():
    prop, u0 = heat_problem(17)
    res = mgrit.solve(prop, u0, 64, 0.0, 1.0,
                      mgrit.Config(levels=3, tol=1e-6, tol_kind="relative", max_iter=30))
    assert res.converged and res.initial_residual > 0
    assert res.residuals[-1] <= 1e-6 * res.initial_residual < res.residuals[-2]


def test_nested_guess_starts_closer_than_zero_guess():
    prop, u0 = heat_problem(33)
    kw = dict(levels=4, coarsening=2, tol=1e-10, max_iter=30)
    zero = mgrit.solve(prop, u0, 256, 0.0, 2.0, mgrit.Config(initial_guess="zero", **kw))
    nested = mgrit.solve(prop, u0, 256, 0.0, 2.0, mgrit.Config(initial_guess="nested", **kw))
    assert nested.residuals[0] < 0.01 * zero.residuals[0]
    assert nested.iterations < zero.iterations


def test_exact_initial_guess_is_already_converged():
    prop, u0 = heat_problem(17)
    seq = mgrit.step_sequentially(prop, u0, 64, 0.0, 1.0)
    res = mgrit.solve(prop, u0, 64, 0.0, 1.0, mgrit.Config(levels=3, initial_guess=seq, tol=1e-12))
    assert res.iterations == 1 and res.residuals[0] <= 1e-14


def test_solver_object_reuses_storage_across_solves():
    prop, u0 = heat_problem(17)
    solver = mgrit.Solver(prop, u0, 64, 0.0, 1.0, mgrit.Config(levels=3, tol=1e-12))
    first = solver.solve(u0)
    assert relative_error(first.final, mgrit.step_sequentially(prop, u0, 64, 0.0, 1.0)[-1]) <= 1e-10
    storage = solver.levels[0].u.data_ptr()
    second = solver.solve(2 * u0)
    assert solver.levels[0].u.data_ptr() == storage
    expected = mgrit.step_sequentially(prop, 2 * u0, 64, 0.0, 1.0)
    assert relative_error(second.states, expected) <= 1e-10
