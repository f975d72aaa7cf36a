"""Exact passes on torch's graph across ranks (`mgrit.nn.engine.tape`): mode "carry" trains
one step of exact passes, then switches to warm-started MGRIT, whose first cycles start from
the states the exact passes left (their residuals at round-off), and reports the gradients
of both steps against the plain network's."""

import sys

import torch
from mpi4py import MPI
from torch import nn

import mgrit
from mgrit.app.launch import report

torch.set_num_threads(1)
world = MPI.COMM_WORLD
EXACT = mgrit.Config(levels=1)
WARM = mgrit.Config(levels=2, coarsening=2, relax="F", max_iter=1, tol=0.0,
                    initial_guess="warm", min_coarse=1)


class Step(nn.Module):
    """A step without mgrit's kernels (a norm inside): torch's ops compute it."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.linear = nn.Linear(6, 6)

    def forward(self, u):
        return torch.tanh(self.linear(self.norm(u)))


def network(comm):
    torch.manual_seed(3)
    return mgrit.LayerParallel(Step, 9, forward=EXACT, backward=EXACT, comm=comm,
                               closing=nn.Linear(6, 2)).double()


if sys.argv[1] == "carry":
    model = network(world)
    serial = network(None).to_serial()
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    errors = []
    for step in range(2):
        if step == 1:
            model.set_solvers(WARM, WARM)
        model.zero_grad()
        serial.zero_grad()
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        model(xa).square().sum().backward()
        serial(xb).square().sum().backward()
        lo, hi = model.layer_range
        mine = [p.grad for p in model.layers.params.values()]
        theirs = [torch.stack([dict(serial[1 + n].f.named_parameters())[name].grad
                               for n in range(lo, hi + 1)])
                  for name in model.layers.names]
        errors.append(max([float((a - b).abs().max()) for a, b in zip(mine, theirs)]
                          + [float((xa.grad - xb.grad).abs().max())]))
    stats = {kind: {"residual": model.stats[kind]["residuals"][0],
                    "norm": model.stats[kind]["initial_norm"]}
             for kind in ("forward", "backward")}
    report({"errors": errors, "stats": stats})
