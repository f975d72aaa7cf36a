"""Relaxation phases of narrow dense tanh layers on torch's kernels (MGRIT_NATIVE=torch):
`TorchDense` against `ChainSteps`, whose operations it makes into given tensors; its
planned phases (`TorchProgram`) against their steps taken one by one; layer-parallel
training with them on 1-4 virtual ranks against the same steps taken one by one (bit for
bit) and against `ChainSteps` (to rounding)."""

import random

import pytest
import torch
from torch import nn

from mgrit.kernels import dense, steps
from mgrit.kernels.chain import Chain
from mgrit.nn import propagators

from test_compiled import _chained, _random_case, _train


def _layer(d, dtype, seed):
    torch.manual_seed(seed)
    layer = nn.Sequential(nn.Linear(d, d), nn.Tanh()).to(dtype)
    return {k: v.detach() for k, v in layer.named_parameters()}, Chain.of(layer)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed", range(3))
def test_a_step_makes_the_operations_of_chain_steps(dtype, seed):
    """One step, its kept tanh and one adjoint step of random width and rows equal
    `ChainSteps`'s to the bit: the same calls, written into given tensors."""
    rng = random.Random(seed)
    rows, d = rng.randint(1, 4), rng.randint(1, 40)
    t, chain = _layer(d, dtype, seed)
    ours, theirs = dense.TorchDense(dtype, d), steps.ChainSteps(chain)
    gen = torch.Generator().manual_seed(seed)
    u, g, w = (torch.randn(rows, d, generator=gen, dtype=dtype) for _ in range(3))
    for with_g in (None, g):
        out, ref, kept = torch.empty_like(u), torch.empty_like(u), torch.empty_like(u)
        assert ours.step(u, t["0.weight"], t["0.bias"], 0.3, out, with_g, kept)
        outputs = theirs.step_into(0, t, u, 0.3, ref, with_g, True)
        assert torch.equal(out, ref) and torch.equal(kept, outputs[0][1][0])
        out, ref = torch.empty_like(u), torch.empty_like(u)
        assert ours.vjp_single(t["0.weight"], w, kept, 0.2, out, with_g)
        theirs.vjp_single_into(0, t, w, 0.2, ref, with_g, outputs)
        assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed", range(4))
def test_a_planned_phase_gives_the_bits_of_its_steps_taken_one_by_one(dtype, seed):
    """A march of random length, width and rows as one planned call equals the same steps
    taken in turn: forward with and without g, keeping the tanh, adjoint with zero
    cotangents, and recording parameter cotangents (those against the batched products of
    `ChainSteps`, to rounding)."""
    rng = random.Random(seed)
    count, rows, d = rng.randint(1, 9), rng.randint(1, 4), rng.randint(1, 40)
    kernels = dense.TorchDense(dtype, d)
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

    expected, got = u.clone(), u.clone()
    kept_one, kept_all = (torch.empty(count, rows, d, dtype=dtype) for _ in range(2))
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
    expected, got = a.clone(), a.clone()
    for n in range(count):
        assert kernels.vjp_single(ws[n], expected[n], ys[n], 0.2, expected[n + 1], g[n + 1])
    program = kernels.program([(ws[n], got[n], ys[n], g[n + 1], got[n + 1])
                               for n in range(count)], 0.2, True)
    program()
    assert torch.equal(got, expected)
    assert torch.equal(got[1], g[1])

    xs = torch.randn(count, rows, d, dtype=dtype)
    got = a.clone()
    gw, gb = torch.full((count, d, d), 7.0, dtype=dtype), torch.full((count, d), 7.0,
                                                                      dtype=dtype)
    program = kernels.program([(ws[n], got[n], ys[n], g[n + 1], got[n + 1], xs[n], gw[n],
                                gb[n]) for n in range(count)], 0.2, True)
    program()
    assert torch.equal(got, expected)
    # each step's s = a (1 - y^2) from the input it read; cotangents s^T x and sum of rows
    s = torch.stack([got[n] for n in range(count)]) * (1 - ys * ys)
    ref_w, ref_b = torch.bmm(s.transpose(1, 2), xs), s.sum(1)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(gw, ref_w, rtol=tol, atol=tol)
    assert torch.allclose(gb, ref_b, rtol=tol, atol=tol)
    assert not gw[0].any() and not gb[0].any()     # a zero cotangent: zero


def test_a_planned_phase_reads_new_operands_and_declines_what_does_not_suit():
    """`set_operand` points a phase at new tensors of the right size, dtype and layout (the
    next run reads them) and refuses others, keeping its old ones; a program is refused for
    operands of another dtype, layout or size or a missing one but g."""
    kernels = dense.TorchDense(torch.float64, 5)
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

    good = [(u[0], ws[0], bs[0], None, u[1]), (u[1], ws[1], bs[1], g[2], u[2])]
    assert kernels.program(good, 0.1, False) is not None
    bad = {"dtype": (u[0].float(), ws[0], bs[0], None, u[1]),
           "layout": (u[0], ws[0].t(), bs[0], None, u[1]),
           "size": (u[0], ws[0][:2], bs[0], None, u[1]),
           "missing": (u[0], ws[0], None, None, u[1])}
    for name, step in bad.items():
        assert kernels.program([good[0], step], 0.1, False) is None, name
    assert kernels.program([], 0.1, False) is None


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_training_with_planned_phases_equals_chain_steps(ranks, dtype, monkeypatch):
    """Two training steps of random dense tanh networks on 1-4 virtual ranks with torch's
    kernels: outputs and every rank's parameter gradients with planned phases equal those
    of `ChainSteps` (no planned phase) to rounding, and those of the same strategy with
    no phase planned (its marches step by step, its batches `ChainSteps`'s) alike; planned
    phases ran, forward and adjoint, keeping op outputs and recording parameter cotangents
    in some case."""
    ran, kinds = [], set()
    count = lambda self, _f=dense.TorchProgram.__call__: ran.append(self) or _f(self)  # noqa: E731
    monkeypatch.setattr(dense.TorchProgram, "__call__", count)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for seed in range(3):
        case = _random_case(100 * ranks + seed)
        ran.clear()
        planned = _train("torch", ranks, case, dtype, monkeypatch)
        kinds |= {("adjoint" if p._adjoint else "forward", len(p._steps[0])) for p in ran}
        assert ran, case
        monkeypatch.setattr(propagators, "compiled_phases", lambda: False)
        stepwise = _train("torch", ranks, case, dtype, monkeypatch)
        monkeypatch.setattr(steps, "TORCH_PROGRAMS", False)
        plain = _train("torch", ranks, case, dtype, monkeypatch)
        monkeypatch.undo()
        monkeypatch.setattr(dense.TorchProgram, "__call__", count)
        assert len(planned) == len(stepwise) == len(plain)
        for got, twin, ref in zip(planned, stepwise, plain):
            scale = float(ref.abs().max()) or 1.0
            assert float((got - ref).abs().max()) <= tol * scale, case
            assert float((twin - ref).abs().max()) <= tol * scale, case
    assert {k for k, _ in kinds} == {"forward", "adjoint"}, kinds
    assert ("forward", 6) in kinds and ("adjoint", 8) in kinds, kinds
