"""Every rank trains a small layer-parallel network over MPI with its coarse levels gathered
(`Config.agglomerate`) and passed from rank to rank, and reports the largest relative
difference of outputs, losses, residual histories and parameter gradients."""

import sys
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).parent.parent))  # nets.py
import mgrit  # noqa: E402
from mgrit.app.launch import report  # noqa: E402
from nets import PARTS, data  # noqa: E402

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
SETTINGS = [(2, 4, "F", "nested", 0, 0), (3, 2, ("F", "FCF"), "zero", 2, 1),
            (3, 2, "F", "nested", 1, 0)]


def train(kind, num_steps, forward, backward):
    torch.manual_seed(1)
    opening, closing, step = PARTS[kind]()
    model = mgrit.LayerParallel(step, num_steps, 1.0, forward=forward, backward=backward,
                                comm=comm, opening=opening, closing=closing).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = data(kind, 4)
    for _ in range(2):
        optimizer.zero_grad()
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        optimizer.step()
    return out.detach(), loss.detach(), [p.grad.clone() for p in model.parameters()], \
        model.stats


def differences(a, b):
    """The largest relative difference of outputs, losses, parameter gradients and residual
    histories between two runs."""
    pairs = [(a[0], b[0]), (a[1], b[1]), *zip(a[2], b[2])]
    pairs += [(torch.tensor(a[3][k]["residuals"]), torch.tensor(b[3][k]["residuals"]))
              for k in ("forward", "backward")]
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-300)) for x, y in pairs)


results = {}
for kind, num_steps in (("dense", 30), ("conv", 16)):
    for levels, m, relax, guess, up, down in SETTINGS:
        def config(cycles, agglomerate):
            return mgrit.Config(levels=levels, coarsening=m, relax=relax, initial_guess=guess,
                                max_iter=cycles, tol=0.0, min_coarse=1, agglomerate=agglomerate)
        a = train(kind, num_steps, config(up, 1000), config(down, 1000))
        b = train(kind, num_steps, config(up, 0), config(down, 0))
        results[f"{kind}-{num_steps} L{levels} {guess} {up}/{down}"] = differences(a, b)
report({"results": results})
