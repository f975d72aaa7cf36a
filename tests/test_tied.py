"""Step factories whose layers share parameters (tied weights) are refused at construction,
on every rank, before any work: LayerParallel would otherwise train each layer's copy apart
where the serial network ties them."""

import pytest
import torch
from torch import nn

import mgrit

EXACT = mgrit.Config(levels=1)


def test_a_factory_returning_one_module_is_refused():
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    with pytest.raises(ValueError, match=r"returned the same module .* for layers 0 and 1: "
                                         r"weights tied across layers are not supported"):
        mgrit.LayerParallel(lambda: block, 6, forward=EXACT, backward=EXACT)


def test_layers_sharing_some_parameters_are_refused_naming_the_parameter():
    shared = nn.Linear(8, 8)
    calls = []

    def factory():
        calls.append(1)
        # layers 0..2 have their own first Linear; from layer 3 on it is one shared module
        first = shared if len(calls) > 3 else nn.Linear(8, 8)
        return nn.Sequential(first, nn.Tanh(), nn.Linear(8, 8))

    with pytest.raises(ValueError, match=r"gave layer 4 the parameter '0.weight' of layer 3"):
        mgrit.LayerParallel(factory, 6, forward=EXACT, backward=EXACT)


def test_a_parameter_used_twice_inside_one_layer_is_accepted():
    """Tying inside a layer (the same Linear applied twice) is that layer's own business:
    the forward pass equals the serial network's."""
    def factory():
        lin = nn.Linear(8, 8)
        return nn.Sequential(lin, nn.Tanh(), lin, nn.Tanh())

    torch.manual_seed(3)
    model = mgrit.LayerParallel(factory, 5, forward=EXACT, backward=EXACT).double()
    torch.manual_seed(3)
    serial = mgrit.serial_resnet(factory, 5).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    out, ref = model(x), serial(x)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    ref.sum().backward()
    grad = model.layers.params["0__weight"].grad
    for n in range(5):
        assert torch.allclose(grad[n], serial[n + 1].f[0].weight.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_tied_factories_are_refused_on_every_rank(mpi, nprocs):
    run = mpi("tied.py", nprocs, timeout=120)
    assert run.returncode == 0, run.stderr
    for rank, rep in run.by_rank().items():
        assert "weights tied across layers are not supported" in rep["error"], (rank, rep)


def test_a_frozen_parameter_shared_by_every_layer_is_accepted():
    """A shared parameter that is never trained stays equal in every layer's copy: the
    network is the serial one (outputs and the trainable layers' gradients)."""
    scale = nn.Parameter(torch.full((8,), 0.5), requires_grad=False)

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.scale = scale

        def forward(self, u):
            return torch.tanh(self.lin(u)) * self.scale

    torch.manual_seed(4)
    model = mgrit.LayerParallel(Scaled, 5, forward=EXACT, backward=EXACT).double()
    torch.manual_seed(4)
    serial = mgrit.serial_resnet(Scaled, 5).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    out, ref = model(x), serial(x)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    ref.sum().backward()
    grad = model.layers.params["lin__weight"].grad
    for n in range(5):
        assert torch.allclose(grad[n], serial[n + 1].f.lin.weight.grad, rtol=1e-10, atol=1e-12)
