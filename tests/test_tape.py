"""Exact passes on torch's graph (`mgrit.nn.engine.tape`): where both passes are exact and
the steps compute with torch's ops, a training step evaluates every layer once, as serial
PyTorch's does, and gives serial's gradients; a warm-started solve that takes over starts
from the states those passes left; a second backward pass through one forward pass is
refused by name."""

import pytest
import torch
from torch import nn

import mgrit

EXACT = mgrit.Config(levels=1)
WARM = mgrit.Config(levels=2, coarsening=2, relax="F", max_iter=1, tol=0.0,
                    initial_guess="warm", min_coarse=1)
CALLS: list[int] = []       # one entry per evaluation of a step module, on any copy


class Counted(nn.Module):
    """A step that mgrit's kernels do not cover (a norm inside), counting its calls."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, u):
        CALLS.append(1)
        return torch.tanh(self.linear(self.norm(u)))


def network(layers=7, forward=EXACT, backward=EXACT):
    torch.manual_seed(4)
    return mgrit.LayerParallel(Counted, layers, forward=forward, backward=backward,
                               closing=nn.Linear(6, 2)).double()


def batch():
    return torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))


def test_an_exact_step_evaluates_every_layer_once_and_gives_serials_gradients():
    model = network()
    serial = network().to_serial()
    serial.get_submodule("1.f.linear").weight.requires_grad_(False)   # a frozen parameter
    model.layers.params["linear__weight"].requires_grad_(False)
    model(batch()).sum()        # the first pass also checks the step module once
    xa, xb = batch().requires_grad_(), batch().requires_grad_()
    CALLS.clear()
    model(xa).square().sum().backward()
    assert len(CALLS) == 7      # the solvers' adjoint would evaluate each layer again
    serial(xb).square().sum().backward()
    assert torch.allclose(xa.grad, xb.grad, rtol=1e-13, atol=1e-15)
    assert model.layers.params["linear__weight"].grad is None
    for name in ("norm.weight", "norm.bias", "linear.bias"):
        theirs = torch.stack([dict(serial[1 + n].f.named_parameters())[name].grad
                              for n in range(7)])
        mine = model.layers.params[name.replace(".", "__")].grad
        assert torch.allclose(mine, theirs, rtol=1e-13, atol=1e-15), name
    assert model.stats["forward"]["residuals"] == [0.0]
    assert model.stats["backward"]["iterations"] == 1


def test_mgrit_passes_still_solve():
    model = network(forward=WARM, backward=WARM)
    model(batch()).sum()
    CALLS.clear()
    model(batch()).square().sum().backward()
    assert len(CALLS) > 7


def test_a_second_backward_pass_through_one_exact_pass_is_refused():
    model = network()
    loss = model(batch()).square().sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="graph is gone"):
        loss.backward()


def test_a_state_with_nan_is_refused_before_any_step_as_a_solve_refuses_it():
    model = network()
    model(batch()).sum()
    x = batch()
    x[1, 2] = float("nan")
    CALLS.clear()
    with pytest.raises(ValueError, match="u0 contains NaN or Inf"):
        model(x.requires_grad_())
    assert not CALLS


def test_a_warm_solve_that_takes_over_starts_from_the_exact_passes_states():
    """One exact step, then warm-started MGRIT of one cycle on the same batch and weights
    (no dropout, no update): started from the exact states, both solves' residuals are at
    round-off; started from anything else (zeros), they would be of the states' size."""
    model = network(layers=9)
    x = batch()
    model(x).square().sum().backward()
    model.set_solvers(WARM, WARM)
    model(x).square().sum().backward()
    for kind in ("forward", "backward"):
        stats = model.stats[kind]
        assert stats["iterations"] == 1
        assert stats["residuals"][0] < 1e-13 * stats["initial_norm"], (kind, stats)


@pytest.mark.mpi
def test_on_ranks_exact_passes_give_serials_gradients_and_carry_their_states(mpi):
    """On 3 ranks: a first, a middle and a last rank, each with its own rows' layout."""
    run = mpi("tape.py", 3, "carry", timeout=120)
    assert run.returncode == 0, run.stderr
    for rep in run.by_rank().values():
        assert max(rep["errors"]) < 1e-12, rep
        for kind, stats in rep["stats"].items():
            assert stats["residual"] < 1e-13 * stats["norm"], (kind, rep)


def test_the_side_by_side_benchmark_times_exact_passes_next_to_serial_pytorch():
    """`python -m benchmarks.ab . --exact --serial`: serial PyTorch first, then each
    version's exact passes, every one timed in every round."""
    from benchmarks.ab import compare

    times = compare(["."], "w5", 2, exact=True, serial=True)
    assert len(times) == 2
    for measured in times:
        assert sorted(measured) == ["forward", "train_step"]
        assert all(len(runs) == 2 and min(runs) > 0 for runs in measured.values())
