"""The executors against the loop executor, and one level against serial autograd, on W2
and W2b (1024 dense tanh layers, batch 1 and 32), in float64 and float32: a no-grad forward
pass (run twice, so that captured sweeps are replayed), then a whole training step's output
and every parameter gradient.

On a GPU (marked `gpu`) this is where the batched executor's CUDA kernels, the stream
executor and the CUDA graphs of sweeps are checked; on the CPU (W2 only, `slow`) the same
comparisons run, so that what the GPU run asserts is kept working where there is no GPU."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import Tensor

from benchmarks.training import build, gradient_pairs, sequential_variant
from benchmarks.workloads import TRAINING_WORKLOADS, TrainingWorkload

EXECUTORS = {"batched": {"execution": "batched"},
             "cuda graphs": {"execution": "batched", "cuda_graphs": True}}
# relative to the reference's largest entry: a float32 training step goes through 1024
# layers and three MGRIT cycles in another order of operations than the loop's
TOLERANCE = {torch.float64: 1e-11, torch.float32: 1e-4}
CASES = [pytest.param("cpu", "w2", marks=pytest.mark.slow),
         pytest.param("cuda", "w2", marks=pytest.mark.gpu),
         pytest.param("cuda", "w2b", marks=pytest.mark.gpu)]
DTYPES = [torch.float64, torch.float32]


def _relative_error(actual: Tensor, expected: Tensor) -> float:
    """max|actual - expected| / max|expected| (NaN where either holds one)."""
    diff = (actual.double() - expected.double()).abs().max()
    scale = expected.double().abs().max()
    return float(diff / scale) if scale > 0 else float(diff)


def _results(model: torch.nn.Module, work: TrainingWorkload, device: str,
             dtype: torch.dtype) -> list[Tensor]:
    """Two no-grad forward outputs, a training step's output, then every parameter's
    gradient in the order of `model.parameters()` (on the CPU)."""
    model = model.to(device=device, dtype=dtype)
    x, y = work.inputs(torch.Generator().manual_seed(1))
    x, y = x.to(device=device, dtype=dtype), y.to(device)
    with torch.no_grad():
        evaluated = [model(x).clone() for _ in range(2)]
    out = model(x)
    work.loss(out, y).backward()
    return [t.detach().cpu() for t in (*evaluated, out, *(p.grad for p in model.parameters()))]


@functools.lru_cache(maxsize=None)
def _loop_results(name: str, device: str, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """The loop executor's results: the reference of every other executor (computed once
    per case)."""
    work = TRAINING_WORKLOADS[name]().with_solver(execution="loop")
    return tuple(_results(build(work)[0], work, device, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("device,name", CASES)
def test_executor_matches_the_loop_executor(device, name, executor, dtype):
    work = TRAINING_WORKLOADS[name]().with_solver(**EXECUTORS[executor])
    model = build(work)[0]
    labels = ["forward", "forward again", "training output"] + [
        f"gradient of {n}" for n, _ in model.named_parameters()]
    got = _results(model, work, device, dtype)
    expected = _loop_results(name, device, dtype)
    assert len(got) == len(expected) == len(labels)
    errors = [_relative_error(a, b) for a, b in zip(got, expected)]
    failed = [(label, e) for label, e in zip(labels, errors) if not e <= TOLERANCE[dtype]]
    assert not failed, failed     # NaN never passes
    # a forward pass that was not computed (a replay of nothing) differs from the loop's
    assert float(got[0].abs().max()) > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device,name", CASES)
def test_one_level_matches_serial_autograd(device, name, dtype):
    """levels=1 steps every layer once each way: serial autograd's output and gradients."""
    work = sequential_variant(TRAINING_WORKLOADS[name]())
    model, serial = build(work)
    x, y = work.inputs(torch.Generator().manual_seed(1))
    x, y = x.to(device=device, dtype=dtype), y.to(device)
    outputs = []
    for net in (model, serial):
        net.to(device=device, dtype=dtype)
        out = net(x)
        work.loss(out, y).backward()
        outputs.append(out.detach())
    assert _relative_error(*outputs) <= TOLERANCE[dtype]
    pairs = gradient_pairs(model, serial)
    assert len(pairs) == len(list(serial.parameters()))
    errors = [_relative_error(a, b) for a, b in pairs]
    assert max(errors) <= TOLERANCE[dtype], max(errors)
