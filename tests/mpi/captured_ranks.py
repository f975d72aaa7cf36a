"""Captured training steps and forward passes on several MPI ranks against eager ones on the
same ranks: on a CUDA device each rank's step and pass are captured as graphs between their
messages (`mgrit.comm.cuts`) and replayed; on a CPU the same static-buffer runs are eager.
Six steps of each from the same weights and batches, then four no-grad passes; every rank
reports how far apart the losses, its parameters and the outputs are, and what was
captured (graphs, host steps).

    mpiexec -n P python -m mpi4py captured_ranks.py DEVICE WORKLOAD[,WORKLOAD...]
"""

import sys
from pathlib import Path

import torch
from mpi4py import MPI
from torch import Tensor

sys.path.insert(0, str(Path(__file__).parent.parent.parent))  # benchmarks
from benchmarks.training import build  # noqa: E402
from benchmarks.workloads import TRAINING_WORKLOADS  # noqa: E402
from mgrit.app.launch import report  # noqa: E402
from mgrit.nn import CapturedForward, CapturedStep  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
device = torch.device(sys.argv[1])
workloads = sys.argv[2].split(",")
STEPS = 6


def relative_error(actual: Tensor, expected: Tensor) -> float:
    diff = (actual.double() - expected.double()).abs().max()
    scale = expected.double().abs().max()
    return float(diff / scale) if scale > 0 else float(diff)


def optimizer(work, model):
    opt = work.optimizer(model.parameters())
    if device.type == "cuda" and "capturable" in opt.defaults:
        for group in opt.param_groups:
            group["capturable"] = True
    return opt


records = []
for name in workloads:
    work = TRAINING_WORKLOADS[name]()
    batches = [tuple(t.to(device) for t in work.inputs(torch.Generator().manual_seed(k)))
               for k in range(STEPS)]
    batches = [(x.double(), y) for x, y in batches]
    runs = {}
    for label in ("eager", "captured"):
        model = build(work, comm=world)[0].to(device=device, dtype=torch.float64)
        opt = optimizer(work, model)
        losses = []
        if label == "eager":
            for x, y in batches:
                opt.zero_grad()
                loss = work.loss(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.detach().clone())
            for _ in range(4):
                with torch.no_grad():
                    output = model(batches[0][0])
            counts = {}
        else:
            step = CapturedStep(model, work.loss, opt, *batches[0])
            for x, y in batches:
                losses.append(step.step(x, y).clone())
            forward = CapturedForward(model, batches[0][0])
            for _ in range(4):      # the last one a replay (on CUDA)
                output = forward(batches[0][0]).clone()
            counts = {"step_captures": step.captures, "forward_captures": forward.captures}
            for what, captured in (("step", step), ("forward", forward)):
                graph = captured._graph
                counts[f"{what}_graphs"] = getattr(graph, "graphs", 0)
                counts[f"{what}_host_steps"] = getattr(graph, "host_steps", 0)
                counts[f"{what}_replays"] = getattr(graph, "replays", 0)
        runs[label] = (losses, [p.detach().clone() for p in model.parameters()], output,
                       counts)
    (eager_losses, eager_params, eager_out, _) = runs["eager"]
    (losses, params, out, counts) = runs["captured"]
    records.append({
        "workload": name, "device": str(out.device),
        "loss_error": max(relative_error(a, b) for a, b in zip(losses, eager_losses)),
        "parameter_error": max(relative_error(a, b) for a, b in zip(params, eager_params)),
        "output_error": relative_error(out, eager_out), **counts})
report({"records": records})
