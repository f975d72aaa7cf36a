"""Compiled relaxation phases (kernels="auto") against their twin, the same native kernels
called step by step from Python (kernels="kernels"), and against torch's kernels:
the phase kernels on random operands, and layer-parallel training on random shapes on 1-4
virtual ranks (forward, adjoint, parameter gradients; float64 and float32). The phase
tests on random operands also take torch's planned phases (`TorchDense`, whose training
tests are in test_torch_programs.py)."""

import random

import pytest
import torch
from torch import nn

import mgrit
from mgrit.comm.virtual import run_ranks
from mgrit.kernels import dense, native
from mgrit.nn.engine import adjoint_phase

from test_native import native_kernels, needs_native  # noqa: F401 (the fixture)


def _chained(count, rows, d, dtype, seed):
    """A march's operands: states (count + 1, rows, d), one layer per step (separate
    tensors, as ghost layers are), g per step."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(count + 1, rows, d, generator=gen, dtype=dtype)
    ws = [torch.randn(d, d, generator=gen, dtype=dtype) / d ** 0.5 for _ in range(count)]
    bs = [torch.randn(d, generator=gen, dtype=dtype) for _ in range(count)]
    g = torch.randn(count + 1, rows, d, generator=gen, dtype=dtype)
    return u, ws, bs, g


def phases_against_steps(make, dtype, seed, zero_skips_y):
    """A march of random length, width and rows, with and without g, and keeping the tanh
    of every step, as one program of the kernels `make(dtype, width)` gives, equals the same
    steps by their one-layer call in turn (each step reading the previous one's output), and
    so does the adjoint's march with kept tanh values, a zero cotangent included (whose tanh
    is NaN where `zero_skips_y`: the kernels must not read it). Returns what a test of the
    adjoint's recorded cotangents goes on with: (kernels, ws, g, the cotangents a, the
    adjoint march's result, the tanh values ys)."""
    rng = random.Random(seed)
    count, rows, d = rng.randint(1, 9), rng.randint(1, 4), rng.randint(1, 40)
    kernels = make(dtype, d)
    u, ws, bs, g = _chained(count, rows, d, dtype, seed)
    for with_g in (False, True):
        expected, got = u.clone(), u.clone()
        for n in range(count):
            assert kernels.step(expected[n], ws[n], bs[n], 0.3, expected[n + 1],
                                g[n + 1] if with_g else None)
        program = kernels.program([(got[n], ws[n], bs[n], g[n + 1] if with_g else None,
                                    got[n + 1]) for n in range(count)], 0.3, False)
        program()
        assert program.count == count
        assert torch.equal(got, expected)
        assert not torch.equal(got[1:], u[1:])      # it did write

    # keeping the tanh of every step, as the forward's final sweep does
    expected, got = u.clone(), u.clone()
    kept_one, kept_all = torch.empty(count, rows, d, dtype=dtype), torch.empty(count, rows, d,
                                                                               dtype=dtype)
    for n in range(count):
        assert kernels.step(expected[n], ws[n], bs[n], 0.3, expected[n + 1], g[n + 1],
                            kept_one[n])
    program = kernels.program([(got[n], ws[n], bs[n], g[n + 1], got[n + 1], kept_all[n])
                               for n in range(count)], 0.3, False)
    program()
    assert torch.equal(got, expected) and torch.equal(kept_all, kept_one)

    ys = torch.tanh(torch.randn(count, rows, d, dtype=dtype))
    a = torch.randn(count + 1, rows, d, dtype=dtype)
    a[0] = 0.0                    # a zero cotangent maps to g
    if zero_skips_y:
        ys[0] = float("nan")
    expected, got = a.clone(), a.clone()
    for n in range(count):
        assert kernels.vjp_single(ws[n], expected[n], ys[n], 0.2, expected[n + 1], g[n + 1])
    program = kernels.program([(ws[n], got[n], ys[n], g[n + 1], got[n + 1])
                               for n in range(count)], 0.2, True)
    program()
    assert torch.equal(got, expected)
    assert torch.equal(got[1], g[1])
    return kernels, ws, g, a, expected, ys


@needs_native
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed", range(4))
def test_a_phase_gives_the_bits_of_its_steps_taken_one_by_one(dtype, seed):
    """`phases_against_steps` on the native kernels (a zero cotangent's tanh not read), and
    the adjoint's march recording parameter cotangents against the batched kernel's."""
    kernels, ws, g, a, _, ys = phases_against_steps(dense.NativeDense, dtype, seed, True)
    count, rows, d = ys.shape

    # recording the parameter cotangents too, as the adjoint's final sweep does
    xs = torch.randn(count, rows, d, dtype=dtype)
    expected, got = a.clone(), a.clone()
    gw_one, gb_one = torch.empty(count, d, d, dtype=dtype), torch.empty(count, d, dtype=dtype)
    gw_all, gb_all = torch.full_like(gw_one, 7.0), torch.full_like(gb_one, 7.0)
    for n in range(count):
        assert kernels.vjp(ws[n][None], expected[n][None], ys[n][None], 0.2,
                           expected[n + 1][None], g[n + 1][None], xs[n][None], gw_one[n][None],
                           gb_one[n][None])
    program = kernels.program([(ws[n], got[n], ys[n], g[n + 1], got[n + 1], xs[n], gw_all[n],
                                gb_all[n]) for n in range(count)], 0.2, True)
    program()
    assert torch.equal(got, expected)
    assert torch.equal(gw_all, gw_one) and torch.equal(gb_all, gb_one)
    assert not gw_all[0].any() and not gb_all[0].any()     # a zero cotangent: zero


def _kernels(name, request):
    """The kernels whose programs a test takes: native (C; the `native_kernels` fixture
    builds them or skips) or torch's (planned calls)."""
    if name == "native":
        request.getfixturevalue("native_kernels")
        return dense.NativeDense
    return dense.TorchDense


@pytest.mark.parametrize("name", ["native", "torch"])
def test_a_phase_reads_an_operand_from_new_tensors_that_suit_it(name, request):
    """`set_operand` points a program's steps at new tensors (the adjoint's kept tanh
    values of a new pass): the next run reads them; tensors of another size, dtype or
    layout are refused and the program keeps its old ones."""
    kernels = _kernels(name, request)(torch.float64, 5)
    u, ws, bs, g = _chained(3, 2, 5, torch.float64, 1)
    a = torch.randn(4, 2, 5, dtype=torch.float64)
    ys = [torch.tanh(torch.randn(2, 5, dtype=torch.float64)) for _ in range(3)]
    got = a.clone()
    program = kernels.program([(ws[n], got[n], ys[n], None, got[n + 1]) for n in range(3)],
                              0.2, True)
    fresh = [torch.tanh(torch.randn(2, 5, dtype=torch.float64)) for _ in range(3)]
    assert not program.set_operand(2, [fresh[0], fresh[1], fresh[2].float()])
    assert not program.set_operand(2, [fresh[0], fresh[1], fresh[2][:1]])
    assert not program.set_operand(2, [fresh[0], fresh[1], fresh[2].t()])
    assert program.set_operand(2, fresh)
    program()
    expected = a.clone()
    for n in range(3):
        assert kernels.vjp_single(ws[n], expected[n], fresh[n], 0.2, expected[n + 1])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", ["native", "torch"])
def test_a_phase_declines_operands_the_kernels_cannot_read(name, request):
    """Another dtype, a non-contiguous operand, a wrong size or a missing operand other
    than g: no program (the solver then takes the steps one by one)."""
    kernels = _kernels(name, request)(torch.float64, 4)
    u, ws, bs, g = _chained(2, 1, 4, torch.float64, 0)
    good = [(u[0], ws[0], bs[0], None, u[1]), (u[1], ws[1], bs[1], g[2], u[2])]
    assert kernels.program(good, 0.1, False) is not None
    bad = {"dtype": (u[0].float(), ws[0], bs[0], None, u[1]),
           "layout": (u[0], ws[0].t(), bs[0], None, u[1]),
           "size": (u[0], ws[0][:2], bs[0], None, u[1]),
           "missing": (u[0], ws[0], None, None, u[1])}
    for name, step in bad.items():
        assert kernels.program([good[0], step], 0.1, False) is None, name
    assert kernels.program([], 0.1, False) is None


def _network(width, layers, seed, dtype, comm, config, kernels=None):
    torch.manual_seed(seed)
    model = mgrit.LayerParallel(lambda: nn.Sequential(nn.Linear(width, width), nn.Tanh()),
                                layers, 1.0, forward=config, backward=config, comm=comm,
                                opening=nn.Linear(3, width), closing=nn.Linear(width, 2),
                                kernels=kernels)
    return model.to(dtype)


def _train(mode, ranks, case, dtype, monkeypatch, counts=None):
    """Outputs and gradients of two training steps of a random dense tanh network on
    `ranks` virtual ranks with kernels=mode, every rank's, in order."""
    width, batch, layers, levels, m, relax, seed = case
    config = mgrit.Config(levels=levels, coarsening=m, relax=relax, max_iter=2, tol=0.0,
                          min_coarse=1)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, generator=gen, dtype=dtype)
    y = torch.randint(0, 2, (batch,), generator=gen)

    def program(comm):
        model = _network(width, layers, seed, dtype, comm, config, mode)
        results = []
        for _ in range(2):
            out = model(x)
            nn.functional.cross_entropy(out, y).backward()
            results += [out.detach()] + [p.grad.clone() for p in model.parameters()]
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.5 * p.grad
                    p.grad = None
        return results

    return [t for rank in run_ranks(ranks, program) for t in rank]


def _random_case(seed):
    rng = random.Random(seed)
    levels, m = rng.randint(2, 4), rng.randint(2, 4)
    relax = tuple(rng.choice(["F", "FCF"]) for _ in range(levels - 1))
    coarsest = m ** (levels - 1)            # layers for one step on the coarsest level
    return (rng.randint(2, 24), rng.randint(1, 3), rng.randint(coarsest, 2 * coarsest + 9),
            levels, m, relax, seed)


@needs_native
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_training_with_compiled_phases_equals_its_twin_bit_for_bit(ranks, dtype, monkeypatch):
    """Two training steps of random dense tanh networks (width, batch, depth, levels,
    coarsening, relaxation drawn at random) on 1-4 virtual ranks: outputs and every rank's
    parameter gradients with compiled phases equal those of the same kernels called step by
    step exactly, and those of torch's kernels to rounding; compiled phases did run, forward
    and adjoint, and so did the final sweeps' phases that keep op outputs and record
    parameter cotangents."""
    ran, every = [], set()
    monkeypatch.setattr(dense.DenseProgram, "__call__",
                        lambda self, _f=dense.DenseProgram.__call__: ran.append(self) or _f(self))
    for seed in range(3):
        case = _random_case(100 * ranks + seed)
        ran.clear()
        compiled = _train("auto", ranks, case, dtype, monkeypatch)
        names = {p._call.__name__ for p in ran}
        every |= names
        kinds = {"adjoint" if "vjp" in name else "forward" for name in names}
        stepwise = _train("kernels", ranks, case, dtype, monkeypatch)
        plain = _train("torch", ranks, case, dtype, monkeypatch)
        assert len(compiled) == len(stepwise) == len(plain)
        for got, twin, ref in zip(compiled, stepwise, plain):
            assert torch.equal(got, twin), case
            scale = float(ref.abs().max()) or 1.0
            tol = 1e-12 if dtype == torch.float64 else 2e-5
            assert float((got - ref).abs().max()) <= tol * scale, case
        assert ran, case
        assert kinds == {"forward", "adjoint"}, (case, kinds)
    # the final fine sweeps' phases, which keep op outputs (forward) and record parameter
    # cotangents (adjoint), ran too, in some case
    assert any("keep" in name for name in every), every
    assert any("record" in name for name in every), every


@needs_native
def test_adjoint_phases_follow_forward_outputs_that_are_new_tensors(monkeypatch):
    """Where the forward pass keeps its op outputs in the same tensors pass after pass (its
    native strategy), an adjoint phase is compiled once and never refreshed; where a fine
    batch is too large for the native kernels (with a scalar tanh, as the kernels have
    without glibc's vector one), torch's strategy keeps them in new tensors
    each pass and the phases reading them take the new addresses before they run (still
    compiled once each); the results equal the twin's exactly in both cases."""
    compiled, refreshed = [], []
    for name, calls in (("_compile", compiled), ("_refresh", refreshed)):
        original = getattr(adjoint_phase.AdjointPhase, name)
        monkeypatch.setattr(adjoint_phase.AdjointPhase, name,
                            lambda self, _f=original, _c=calls: _c.append(self) or _f(self))
    # as where the kernels' tanh is scalar: large forward batches go to torch
    monkeypatch.setattr(native, "vector_tanh", lambda: False)
    small = (4, 1, 16, 3, 2, ("F", "FCF"), 1)      # 4 values per state: native batches
    wide = (32, 4, 16, 3, 2, ("F", "FCF"), 1)      # 128 values: fine batches go to torch
    for case, again in ((small, False), (wide, True)):
        compiled.clear()
        refreshed.clear()
        got = _train("auto", 1, case, torch.float64, monkeypatch)
        assert compiled and len(compiled) == len({id(p) for p in compiled}), case
        assert bool(refreshed) == again, case
        twin = _train("kernels", 1, case, torch.float64, monkeypatch)
        assert all(torch.equal(a, b) for a, b in zip(got, twin))
