"""Gradient clipping of LayerParallel against torch's clipping of the serial network."""

import math

import pytest
import torch

import mgrit

from nets import build, data


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_clipping_by_the_global_norm_equals_serial_clipping(mpi, nprocs):
    """levels=1, float64 (exact gradients): the norm of orders 2, inf and 1 is the serial
    network's (the same on every rank), the clipped gradients are serial's clipped ones,
    and after four SGD steps with norm and value clipping the parameters are serial's and
    the replicated opening and closing are identical on every rank."""
    run = mpi("clipping.py", nprocs, "layers", timeout=300)
    assert run.returncode == 0, run.stderr
    reports = run.by_rank()
    for rank, rep in reports.items():
        r = rep["results"]
        for norm_type in (2.0, math.inf, 1.0):
            got = r[f"norm {norm_type}"]
            assert got["lp"] == pytest.approx(got["serial"], rel=1e-12), (rank, norm_type)
            assert got["lp"] == reports[0]["results"][f"norm {norm_type}"]["lp"]
            assert got["clipped"] <= 1e-12, (rank, norm_type, got)
        # the clipping was active: every step's norm was above the bound
        assert min(r["training"]["norms"]) > 0.05
        assert r["training"]["params"] <= 1e-12, (rank, r["training"])
        assert r["training"]["spread"] == 0.0


@pytest.mark.mpi
def test_clipping_with_data_parallel_replicas_takes_the_averaged_gradient(mpi):
    """2 x 2 ranks, each replica on half the batch: the norm is that of the averaged (full
    batch) gradient, counted once, as the serial network's on the whole batch."""
    run = mpi("clipping.py", 4, "data-parallel", timeout=300)
    assert run.returncode == 0, run.stderr
    for rank, rep in run.by_rank().items():
        r = rep["results"]
        for norm_type in (2.0, math.inf, 1.0):
            got = r[f"norm {norm_type}"]
            assert got["lp"] == pytest.approx(got["serial"], rel=1e-12), (rank, norm_type)
            assert got["clipped"] <= 1e-12, (rank, norm_type, got)
        assert r["training"]["params"] <= 1e-12, (rank, r["training"])
        assert r["training"]["spread"] == 0.0


def test_clip_grad_norm_refuses_bad_arguments_and_non_finite_norms():
    model, _ = build("dense", 4, mgrit.Config(levels=1), mgrit.Config(levels=1))
    x, y = data("dense", 3)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match="norm_type must be a positive number or inf"):
        model.clip_grad_norm_(1.0, norm_type=0)
    with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
        model.clip_grad_norm_(-1.0)
    model.layers.params["0__weight"].grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="total norm of order 2.0 .* is nan"):
        model.clip_grad_norm_(1.0, error_if_nonfinite=True)
