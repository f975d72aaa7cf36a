"""Two ranks whose MPI was started with the thread support named on the command line
(mpi4py's rc, set before MPI is imported; run under plain python, as `python -m mpi4py`
starts MPI itself): whether a training pass on CUDA, whose backward autograd runs on a
thread of its own, is refused, for layer-parallel ranks and for data-parallel replicas;
and a training pass on the CPU, whose backward runs on the caller's thread at every level,
against serial autograd."""

import sys
from pathlib import Path

import mpi4py

mpi4py.rc.thread_level = sys.argv[1]
from mpi4py import MPI  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent.parent))  # nets.py
import mgrit  # noqa: E402
from mgrit.app.launch import report  # noqa: E402
from mgrit.comm import split_world  # noqa: E402
from mgrit.nn import layer_parallel  # noqa: E402
from mgrit.nn.checks import check_backward_thread  # noqa: E402
from nets import build, data, owned_pairs, relative  # noqa: E402

EXACT = mgrit.Config(levels=1)

torch.set_num_threads(1)
world = MPI.COMM_WORLD
layer_comm, data_comm = split_world(world, 1)
models = {"layer-parallel": build("dense", 4, EXACT, EXACT, comm=world),
          "replicas": build("dense", 4, EXACT, EXACT, comm=layer_comm, data_comm=data_comm)}
refused = {}
for name, (model, _) in models.items():
    try:
        check_backward_thread(model, torch.device("cuda"))
        refused[name] = None
    except RuntimeError as err:
        refused[name] = str(err)

# the forward pass asks before a training pass alone (an evaluation has no backward)
asked = []
layer_parallel.check_backward_thread = lambda model, device: asked.append(str(device))
model, serial = models["layer-parallel"]
x, y = data("dense", 6)
with torch.no_grad():
    model(x)
nn.functional.cross_entropy(model(x), y).backward()
nn.functional.cross_entropy(serial(x), y).backward()
report({"provided": MPI.Query_thread(), "refused": refused, "asked": asked,
        "grad_error": relative(owned_pairs(model, serial, grad=True))})
