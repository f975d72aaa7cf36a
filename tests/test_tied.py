"""Step factories whose layers share parameters: one module for every layer (weights tied
across depth) trains as the tied serial network; layers sharing only some parameters are
refused at construction, on every rank, before any communication."""

import pytest
import torch
from torch import nn

import mgrit

EXACT = mgrit.Config(levels=1)


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_tied_weights_train_as_the_tied_serial_network(mpi, nprocs):
    """A factory returning one module for every layer (levels=1, float64): the optimizer
    sees the serial network's parameters, one set; their gradients (summed over every
    layer on every rank), the global norm, the parameters after three SGD steps and the
    outputs equal the tied serial network's to round-off, and the tied parameters are
    bitwise equal on every rank."""
    run = mpi("tied.py", nprocs, "train", timeout=300)
    assert run.returncode == 0, run.stderr
    for rank, r in run.by_rank().items():
        assert r["trained"] == r["serial"] == 8 and r["same"], (rank, r)
        assert max(r["grad_errors"]) <= 1e-12, (rank, r)
        for lp, ref in r["norms"]:
            assert lp == pytest.approx(ref, rel=1e-12), (rank, r)
        assert r["params"] <= 1e-12 and r["output"] <= 1e-12, (rank, r)
        assert r["spread"] == 0.0, (rank, r)


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


def test_a_tie_that_stops_part_way_is_refused():
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    calls = []

    def factory():
        calls.append(1)
        return block if len(calls) <= 3 else nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    with pytest.raises(ValueError, match=r"tied layers 0..2 to one module but not layer 3"):
        mgrit.LayerParallel(factory, 6, forward=EXACT, backward=EXACT)


def test_a_parameter_used_twice_inside_one_layer_is_accepted():
    """Tying inside a layer (the same Linear applied twice) is that layer's own business:
    the forward pass equals the serial network's."""
    def factory():
        lin = nn.Linear(8, 8)
        return nn.Sequential(lin, nn.Tanh(), lin, nn.Tanh())

    _matches_serial(factory, 3, "0__weight", lambda layer: layer.f[0].weight)


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_partial_sharing_is_refused_on_every_rank(mpi, nprocs):
    run = mpi("tied.py", nprocs, "partial", timeout=120)
    assert run.returncode == 0, run.stderr
    for rank, rep in run.by_rank().items():
        assert "gave layer 1 the parameter '0.weight' of layer 0" in rep["error"], (rank, rep)


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

    _matches_serial(Scaled, 4, "lin__weight", lambda layer: layer.f.lin.weight)


def test_tied_checkpoints_and_exports_hold_the_updated_weights(tmp_path):
    """Saved and exported after an optimizer step (no forward pass since): the checkpoint's
    serial state, the exported network and a reloaded model all hold the updated tied
    weights, not those of the last forward pass."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    model = mgrit.LayerParallel(lambda: block, 6, forward=EXACT, backward=EXACT).double()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    x = torch.randn(4, 8, dtype=torch.float64)
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    weight = block[0].weight.detach().clone()
    model.save_checkpoint(tmp_path / "ck", opt)
    state = mgrit.nn.serial_state_dict(tmp_path / "ck")
    for n in range(6):
        assert torch.equal(state[f"{n + 1}.f.0.weight"], weight)
    plain = model.to_serial()
    torch.manual_seed(9)
    other = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    again = mgrit.LayerParallel(lambda: other, 6, forward=EXACT, backward=EXACT).double()
    again.load_checkpoint(tmp_path / "ck")
    assert torch.equal(other[0].weight.detach(), weight)
    model.eval(), again.eval()
    with torch.no_grad():
        ref = plain(x)
        assert torch.allclose(model(x), ref, rtol=1e-12, atol=1e-12)
        assert torch.equal(again(x), model(x))


def _matches_serial(factory, seed, row, weight_of):
    """A 5-layer model of `factory` with exact solves gives the serial network's output, and
    its stacked gradient `row` equals each serial layer's (`weight_of(layer)`) gradient."""
    torch.manual_seed(seed)
    model = mgrit.LayerParallel(factory, 5, forward=EXACT, backward=EXACT).double()
    torch.manual_seed(seed)
    serial = mgrit.serial_resnet(factory, 5).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    out, ref = model(x), serial(x)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    ref.sum().backward()
    grad = model.layers.params[row].grad
    for n in range(5):
        assert torch.allclose(grad[n], weight_of(serial[n + 1]).grad, rtol=1e-10, atol=1e-12)
