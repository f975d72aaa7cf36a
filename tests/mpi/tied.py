"""Weights tied across depth on several ranks, against the serial network built from the
same tying factory: mode "train" (levels=1, float64: exact), mode "partial" (layers that
share some parameters: every rank refuses, none waits for another)."""

import sys

import torch
from mpi4py import MPI
from torch import nn

import mgrit
from mgrit.app.launch import report

torch.set_num_threads(1)
world = MPI.COMM_WORLD
EXACT = mgrit.Config(levels=1)


def tied_network(layer_parallel: bool):
    torch.manual_seed(2)
    opening, closing = nn.Linear(5, 8), nn.Linear(8, 3)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    if layer_parallel:
        return mgrit.LayerParallel(lambda: block, 7, forward=EXACT, backward=EXACT,
                                   comm=world, opening=opening, closing=closing).double()
    return mgrit.serial_resnet(lambda: block, 7, 1.0, opening, closing).double()


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


if sys.argv[1] == "partial":
    shared = nn.Linear(8, 8)
    try:
        mgrit.LayerParallel(lambda: nn.Sequential(shared, nn.Tanh(), nn.Linear(8, 8)), 7,
                            comm=world, forward=EXACT, backward=EXACT)
        report({"error": None})
    except ValueError as err:
        report({"error": str(err)})
    sys.exit(0)

model, serial = tied_network(True), tied_network(False)
trained = [p for p in model.parameters() if p.requires_grad]
# the same parameters in the serial network's order: opening, the one block, closing
ordered = [*model.opening.parameters(), *model.tied_step.parameters(),
           *model.closing.parameters()]
gen = torch.Generator().manual_seed(3)
x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
y = torch.randint(0, 3, (6,), generator=gen)
opt_a = torch.optim.SGD(trained, lr=0.2, momentum=0.9)
opt_b = torch.optim.SGD(serial.parameters(), lr=0.2, momentum=0.9)
grad_errors, norms = [], []
for _ in range(3):
    for opt, net in ((opt_a, model), (opt_b, serial)):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
    norms.append((float(model.clip_grad_norm_(1e9)),
                  float(torch.nn.utils.clip_grad_norm_(serial.parameters(), 1e9))))
    ga, gb = flat(p.grad for p in ordered), flat(p.grad for p in serial.parameters())
    grad_errors.append(float((ga - gb).norm() / gb.norm()))
    opt_a.step()
    opt_b.step()
mine = flat(ordered)
every = world.allgather(mine)
with torch.no_grad():
    out_error = float((model(x) - serial(x)).norm() / serial(x).norm())
report({"trained": len(trained), "same": {id(p) for p in trained} == set(map(id, ordered)),
        "serial": len(list(serial.parameters())),
        "grad_errors": grad_errors, "norms": norms,
        "params": float((mine - flat(serial.parameters())).norm() / mine.norm()),
        "spread": max(float((t - every[0]).abs().max()) for t in every),
        "output": out_error})
