"""Persistent messages on MPI: a ring of ranks passes a float64 and a complex64 buffer
around, started again and again with new contents (the solver's boundary values every
cycle), also through the reversed numbering of the adjoint. Each rank reports what it
received per round and what it expected."""

import sys
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).parent.parent))
from mgrit.app.launch import report  # noqa: E402
from mgrit.comm import ReversedComm, recv_init, send_init  # noqa: E402
from mgrit.comm.mpi import MPIComm, _MPIPersistent  # noqa: E402

world = MPIComm(MPI.COMM_WORLD)
rank, size = world.rank, world.size
results = []
for comm in (world, ReversedComm(world)):
    for dtype in (torch.float64, torch.complex64):
        out, into = torch.zeros(3, dtype=dtype), torch.zeros(3, dtype=dtype)
        right, left = (comm.rank + 1) % size, (comm.rank - 1) % size
        sending, receiving = send_init(comm, out, right, 5), recv_init(comm, into, left, 5)
        for k in range(4):
            out.copy_(torch.arange(3) + 10 * comm.rank + 100 * k)
            got = receiving.start()
            sent = sending.start()
            got.wait()
            sent.wait()
            expected = torch.arange(3) + 10 * left + 100 * k
            results.append([into.real.tolist(), expected.tolist()])
report({"results": results, "persistent": isinstance(sending, _MPIPersistent)})
