"""Relaxation phases of narrow dense tanh layers on torch's kernels (kernels="torch"):
`TorchDense` against `ChainSteps`, whose operations it makes into given tensors; its
planned phases (`TorchProgram`) against their steps taken one by one (with the native
programs' tests of test_compiled.py, which take both kernels); layer-parallel
training with them on 1-4 virtual ranks against the same steps taken one by one (bit for
bit) and against `ChainSteps` (to rounding)."""

import random

import pytest
import torch
from torch import nn

from mgrit.kernels import dense, strategies
from mgrit.kernels.chain import Chain
from mgrit.nn.engine import propagators

from test_compiled import _random_case, _train, phases_against_steps


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
    ours, theirs = dense.TorchDense(dtype, d), strategies.ChainSteps(chain)
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
    """`phases_against_steps` on torch's kernels (forward with and without g, keeping the
    tanh, adjoint with a zero cotangent), and the adjoint's march recording parameter
    cotangents: its states as without, its cotangents those of `ChainSteps`'s batched
    products to rounding."""
    kernels, ws, g, a, expected, ys = phases_against_steps(dense.TorchDense, dtype, seed,
                                                           False)
    count, rows, d = ys.shape
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
        monkeypatch.setattr(propagators, "compiled_phases", lambda backend: False)
        stepwise = _train("torch", ranks, case, dtype, monkeypatch)
        plain = _train("torch-steps", ranks, case, dtype, monkeypatch)
        monkeypatch.undo()
        monkeypatch.setattr(dense.TorchProgram, "__call__", count)
        assert len(planned) == len(stepwise) == len(plain)
        for got, twin, ref in zip(planned, stepwise, plain):
            scale = float(ref.abs().max()) or 1.0
            assert float((got - ref).abs().max()) <= tol * scale, case
            assert float((twin - ref).abs().max()) <= tol * scale, case
    assert {k for k, _ in kinds} == {"forward", "adjoint"}, kinds
    assert ("forward", 6) in kinds and ("adjoint", 8) in kinds, kinds
