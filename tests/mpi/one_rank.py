"""A communicator of one MPI rank (a one-rank world, or one replica's layer group split off
a larger one) moves nothing in its collectives: they leave tensors and values as they are
and make no MPI call, so a CUDA tensor is not copied to the host, which a captured step on
one rank (one CUDA graph: such a communicator is not cut) could not hold. A training step
on such communicators then equals serial autograd."""

import sys
from pathlib import Path

import torch
from mpi4py import MPI
from torch import nn

sys.path.insert(0, str(Path(__file__).parent.parent))  # nets.py
import mgrit  # noqa: E402
from mgrit.app.launch import report  # noqa: E402
from mgrit.comm import split_world  # noqa: E402
from mgrit.comm.mpi import MPIComm  # noqa: E402
from nets import build, data, owned_pairs, relative  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
layer_comm, data_comm = split_world(world, world.size)   # one replica: data_comm of one


class NoCalls:
    """An mpi4py communicator that refuses every call."""

    def __getattr__(self, name):
        raise AssertionError(f"MPI call {name} on a communicator of one rank")


calls = []
one = MPIComm(data_comm)
real, one.comm = one.comm, NoCalls()
t = torch.arange(6.0)
try:
    one.allreduce_sum_(t)
    one.bcast_(t, 0)
    one.agree("a setting", (1, "a"))
    same = (torch.equal(t, torch.arange(6.0)) and one.allreduce_sum(2.5) == 2.5
            and one.gather_object({"a": 1}, 0) == [{"a": 1}])
except AssertionError as err:
    calls.append(str(err))
    same = False
one.comm = real

exact = mgrit.Config(levels=1)
model, serial = build("dense", 8, exact, exact, comm=layer_comm, data_comm=data_comm)
x, y = data("dense", 6)
nn.functional.cross_entropy(model(x), y).backward()
nn.functional.cross_entropy(serial(x), y).backward()
report({"calls": calls, "same": same, "data_size": data_comm.Get_size(),
        "grad_error": relative(owned_pairs(model, serial, grad=True))})
