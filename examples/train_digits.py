"""Layer-parallel training in an ordinary PyTorch loop; each step is `train_step`: zero the
gradients, forward pass and loss, backward pass, optimizer step.

    python examples/train_digits.py --epochs 10
    mpiexec -n 2 python -m mpi4py examples/train_digits.py --epochs 10
    mpiexec -n 2 python -m mpi4py examples/train_digits.py --epochs 10 --choose

`--choose` first picks the solver options with `mgrit.nn.choose_settings` on one batch:
of those whose gradient error stays within 0.25 of exact stepping's, and exact stepping
itself, the fastest on these ranks.
"""

import argparse

import torch
from mpi4py import MPI
from torch import nn

import mgrit
from mgrit.app.data import batches, digits
from mgrit.app.loop import train_step

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--choose", action="store_true")
args = parser.parse_args()
torch.set_num_threads(1)
comm = MPI.COMM_WORLD

split = digits()
torch.manual_seed(0)
opening = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh())
closing = nn.Linear(32, 10)
fwd = mgrit.Config(levels=3, coarsening=4, relax=("F", "FCF"), max_iter=2, tol=0.0)
bwd = mgrit.Config(levels=3, coarsening=4, relax=("F", "FCF"), max_iter=1, tol=0.0)
model = mgrit.LayerParallel(lambda: nn.Sequential(nn.Linear(32, 32), nn.Tanh()), 32, 1.0,
                            forward=fwd, backward=bwd, comm=comm, opening=opening,
                            closing=closing)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
order = torch.Generator().manual_seed(0)

if args.choose:
    x0, y0 = next(iter(batches(split.x_train, split.y_train, 32,
                               torch.Generator().manual_seed(0))))
    fwd, bwd = mgrit.nn.choose_settings(
        model, lambda: nn.functional.cross_entropy(model(x0), y0), threshold=0.25)
    model.set_solvers(fwd, bwd)
    if comm.rank == 0:
        print(f"chosen: forward levels={fwd.levels} cycles={fwd.max_iter}, backward "
              f"levels={bwd.levels} cycles={bwd.max_iter}")

for epoch in range(1, args.epochs + 1):
    model.train()
    for x, y in batches(split.x_train, split.y_train, 32, order):
        loss, _ = train_step(model, optimizer, nn.functional.cross_entropy, x, y)
    # the last training step's solves; the evaluation below runs a forward solve of its own
    trained = list(model.stats["forward"]["residuals"])
    model.eval()
    with torch.no_grad():
        accuracy = (model(split.x_test).argmax(1) == split.y_test).float().mean().item()
    if comm.rank == 0:
        print(f"epoch {epoch}: loss {loss.item():.4f}, test accuracy {accuracy * 100:.2f}%, "
              f"forward residuals of the last training step {trained}")

plain = model.to_serial()            # a plain nn.Sequential on rank 0
if comm.rank == 0:
    with torch.no_grad():
        exported = (plain(split.x_test).argmax(1) == split.y_test).float().mean().item()
    print(f"exported serial network: test accuracy {exported * 100:.2f}%")
