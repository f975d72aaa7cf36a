"""Gradient clipping of a layer-parallel network against torch's clipping of the serial one.

Exact solves (levels=1) in float64 give the serial network's gradients to round-off, so the
global norm, the clipped gradients and the parameters after clipped training steps must be
the serial network's. Mode "layers": every rank holds layers of one network; mode
"data-parallel": 2 x 2 ranks, each replica on half the batch, against the serial network
on the whole batch (the averaged gradient is the full batch's).
"""

import sys
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).parent.parent))  # nets.py
import mgrit  # noqa: E402
from mgrit.app.launch import report  # noqa: E402
from nets import build, data, loss_fn, owned_pairs, relative  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
mode = sys.argv[1]
EXACT = mgrit.Config(levels=1)
results = {}


def replicated_spread(model, comm) -> float:
    """The largest difference between ranks of the opening's and closing's parameters."""
    flat = torch.cat([p.detach().reshape(-1) for m in (model.opening, model.closing)
                      for p in m.parameters()])
    every = comm.allgather(flat)
    return max(float((t - every[0]).abs().max()) for t in every)


if mode == "layers":
    comm, data_comm, batch = world, None, slice(None)
else:
    comm, data_comm = mgrit.split_world(world, 2)
    batch = slice(4 * data_comm.Get_rank(), 4 * data_comm.Get_rank() + 4)
x, y = data("dense", 8)
for norm_type, max_norm in ((2.0, 0.05), (float("inf"), 0.01), (1.0, 0.1)):
    model, serial = build("dense", 7, EXACT, EXACT, comm=comm, data_comm=data_comm)
    loss_fn(model(x[batch]), y[batch]).backward()
    loss_fn(serial(x), y).backward()
    norm = model.clip_grad_norm_(max_norm, norm_type)
    ref = torch.nn.utils.clip_grad_norm_(serial.parameters(), max_norm, norm_type)
    results[f"norm {norm_type}"] = {"lp": float(norm), "serial": float(ref),
                                    "clipped": relative(owned_pairs(model, serial, True))}

# training with clipping: the parameters stay the serial network's, the replicated modules
# the same on every rank
model, serial = build("dense", 7, EXACT, EXACT, comm=comm, data_comm=data_comm)
opt_a = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
opt_b = torch.optim.SGD(serial.parameters(), lr=0.5, momentum=0.9)
norms = []
for _ in range(4):
    opt_a.zero_grad()
    loss_fn(model(x[batch]), y[batch]).backward()
    norms.append(float(model.clip_grad_norm_(0.05)))
    model.clip_grad_value_(0.01)
    opt_a.step()
    opt_b.zero_grad()
    loss_fn(serial(x), y).backward()
    torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.05)
    torch.nn.utils.clip_grad_value_(serial.parameters(), 0.01)
    opt_b.step()
results["training"] = {"params": relative(owned_pairs(model, serial)), "norms": norms,
                       "spread": replicated_spread(model, world)}
report({"size": world.size, "results": results})
