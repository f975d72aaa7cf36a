"""Mixed precision in LayerParallel: autocast and low-precision parameters against the
serial network under the same settings."""

import pytest
import torch

import mgrit

from nets import build, data, owned_pairs, relative

EXACT = mgrit.Config(levels=1)
BF16_UNIT = 2.0 ** -8      # bfloat16's unit round-off (8 significant bits)


def _pass(net, x, y, autocast: bool, dtype=torch.bfloat16):
    net.zero_grad()
    with torch.autocast(x.device.type, dtype=dtype, enabled=autocast):
        out = net(x)
        loss = torch.nn.functional.cross_entropy(out.float(), y)
    loss.backward()
    return out.detach().float()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["dense", "conv", "gelu"])
def test_autocast_forward_and_gradients_equal_serial_autocast(kind, device):
    """float32 parameters under autocast to bfloat16, exact solves: output and every
    parameter gradient as the serial network's under the same autocast. The layer-parallel
    adjoint evaluates the same bf16 ops with other batch shapes (its reductions round
    differently), so the gradients agree to a few bf16 round-offs, not bitwise; they must
    be clearly closer to serial autocast's than serial autocast is to serial float32 (the
    adjoint ran under autocast, not in float32)."""
    model, serial = build(kind, 8, EXACT, EXACT)
    model.to(device, torch.float32), serial.to(device, torch.float32)
    x, y = data(kind, 4)
    x, y = x.to(device, torch.float32), y.to(device)
    out = _pass(model, x, y, True)
    ref = _pass(serial, x, y, True)
    assert out.dtype == ref.dtype
    assert float((out - ref).norm() / ref.norm()) <= BF16_UNIT
    pairs = owned_pairs(model, serial, grad=True)
    assert all(a.dtype == torch.float32 for a, _ in pairs)
    error = relative(pairs)
    assert error <= BF16_UNIT
    low = [p.grad.clone() for p in serial.parameters()]
    _pass(serial, x, y, False)
    full = [p.grad.clone() for p in serial.parameters()]
    assert error < 0.6 * relative(list(zip(low, full)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_train_as_the_serial_network(dtype):
    """bf16 / fp16 parameters without autocast: the layer-parallel gradients equal the
    serial network's in the same dtype to a few round-offs of that dtype."""
    model, serial = build("dense", 6, EXACT, EXACT)
    model.to(dtype), serial.to(dtype)
    x, y = data("dense", 4)
    x = x.to(dtype)
    out, ref = _pass(model, x, y, False), _pass(serial, x, y, False)
    unit = torch.finfo(dtype).eps
    assert float((out - ref).norm() / ref.norm()) <= 4 * unit
    assert relative([(a.float(), b.float()) for a, b in owned_pairs(model, serial, True)]
                    ) <= 8 * unit



@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_autocast_across_ranks_equals_serial_autocast(mpi, nprocs):
    """The same as on one process with the layers spread over ranks (bf16 states sent)."""
    run = mpi("precision.py", nprocs, timeout=300)
    assert run.returncode == 0, run.stderr
    for rank, rep in run.by_rank().items():
        for kind, r in rep["results"].items():
            assert r["output"] <= BF16_UNIT and r["grads"] <= BF16_UNIT, (rank, kind, r)
