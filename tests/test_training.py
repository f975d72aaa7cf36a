"""Training loops, data and workload networks."""

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
import torch

import mgrit
from mgrit.app import data as data_module
from mgrit.app.data import batches, digits

from benchmarks import workloads as models
from benchmarks.training import train_digits


def test_digits_split_is_fixed_and_stratified():
    a, b = digits(), digits()
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert a.x_train.shape[1:] == (1, 8, 8) and len(a.x_train) + len(a.x_test) == 1797
    assert float(a.x_train.max()) == 1.0 and float(a.x_train.min()) == 0.0
    counts = torch.bincount(a.y_test, minlength=10)
    assert int(counts.min()) >= 50


def test_digits_are_scikit_learns_without_importing_it(monkeypatch):
    """The CLI's default data set is read from scikit-learn's file: the same arrays as
    `load_digits`, with no second of scikit-learn's import on every rank; and where the file
    is not found, from `load_digits` itself."""
    from sklearn.datasets import load_digits

    reference = load_digits()
    images, target = data_module._digits_arrays()
    assert np.array_equal(images, reference.images) and np.array_equal(target, reference.target)
    probe = ("import sys; from mgrit.app.data import digits; d = digits(); "
             "print(len(d.x_train) + len(d.x_test), "
             "sorted({m.split('.')[0] for m in sys.modules} & {'sklearn', 'scipy'}))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=True)
    assert proc.stdout.split() == ["1797", "[]"]

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    images, target = data_module._digits_arrays()
    assert np.array_equal(images, reference.images) and np.array_equal(target, reference.target)


def test_batches_cover_each_example_once_per_epoch():
    x, y = torch.arange(10.0)[:, None], torch.arange(10)
    seen = torch.cat([yb for _, yb in batches(x, y, 3, torch.Generator().manual_seed(0))])
    assert len(seen) == 9 and len(set(seen.tolist())) == 9   # a final short batch is dropped


def test_exported_network_scores_what_the_layer_parallel_one_scores():
    rec = train_digits(epochs=2, num_steps=16, width=16)
    assert rec["value"] > 0.5
    assert rec["exported_accuracy"] == rec["value"]


def test_sequential_stepping_with_mgrits_kernels_trains_as_serial_pytorch_does():
    """The benchmarks' "sequential stepping, mgrit kernels" row is LayerParallel with one
    level each way: exact gradients, so the same training as the plain network's."""
    small = dict(epochs=2, num_steps=16, width=16)
    stepped, serial = train_digits(sequential=True, **small), train_digits(serial=True, **small)
    assert stepped["method"] == "sequential stepping, mgrit kernels"
    assert stepped["value"] == serial["value"] > 0.5
    assert stepped["exported_accuracy"] == stepped["value"]


def test_workload_networks_have_the_documented_shapes():
    w1 = models.w1()
    x = torch.randn(2, 1, 28, 28)
    u = w1.opening(x)
    assert u.shape == (2, 3, 28, 28) and w1.step()(u).shape == u.shape
    out = w1.closing(u)
    assert out.shape == (2, 10) and torch.allclose(out.exp().sum(1), torch.ones(2))
    w2 = models.w2()
    assert w2.num_steps == 1024 and w2.step()(torch.randn(1, 32)).shape == (1, 32)


@pytest.mark.parametrize("network", [models.w1, models.digits_dense])
def test_layer_parallel_kernels_match_autograd_on_workload_layers(network):
    """The hand-written kernels (Linear, Conv2d, activations) against torch.func."""
    torch.manual_seed(0)
    net = network(num_steps=8)
    exact = mgrit.Config(levels=1)
    model = mgrit.LayerParallel(net.step, 8, 1.0, exact, exact, opening=net.opening,
                                closing=net.closing).double()
    assert model.layers.chain is not None
    torch.manual_seed(0)
    net = network(num_steps=8)
    serial = mgrit.serial_resnet(net.step, 8, 1.0, net.opening, net.closing).double()
    shape = (3, 1, 28, 28) if network is models.w1 else (3, 1, 8, 8)
    x = torch.randn(shape, dtype=torch.float64)
    model(x).square().sum().backward()
    serial(x).square().sum().backward()
    for name in model.layers.names:
        got = model.layers.params[name.replace(".", "__")].grad
        ref = torch.stack([serial[n + 1].f.get_parameter(name).grad for n in range(8)])
        assert torch.allclose(got, ref, rtol=1e-10, atol=1e-12), name
