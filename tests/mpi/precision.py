"""Autocast across ranks: a layer-parallel network under torch.autocast("cpu", bfloat16)
against the serial network under the same autocast (bf16 states cross the ranks)."""

import sys
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).parent.parent))  # nets.py
import mgrit  # noqa: E402
from mgrit.app.launch import report  # noqa: E402
from nets import build, data, owned_pairs, relative  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
EXACT = mgrit.Config(levels=1)
results = {}
for kind in ("dense", "conv"):
    model, serial = build(kind, 7, EXACT, EXACT, comm=world)
    model.float(), serial.float()
    x, y = data(kind, 4)
    x = x.float()
    outs = []
    for net in (model, serial):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net(x)
            loss = torch.nn.functional.cross_entropy(out.float(), y)
        loss.backward()
        outs.append(out.detach().float())
    results[kind] = {"output": float((outs[0] - outs[1]).norm() / outs[1].norm()),
                     "grads": relative(owned_pairs(model, serial, True))}
report({"size": world.size, "results": results})
