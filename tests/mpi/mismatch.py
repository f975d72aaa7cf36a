"""Rank 1 passes a different setting; every rank must get the error before any exchange."""

import sys
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).parent))
import mgrit  # noqa: E402
from mgrit.problems import Dahlquist  # noqa: E402
from reporting import report  # noqa: E402

comm = MPI.COMM_WORLD
what = sys.argv[1]
odd = comm.rank == 1
num_steps = 65 if (what == "num_steps" and odd) else 64
dtype = torch.float32 if (what == "dtype" and odd) else torch.float64
config = mgrit.Config(levels=3, relax="F" if (what == "config" and odd) else "FCF")
try:
    mgrit.solve(Dahlquist(-1.0), torch.tensor(1.0, dtype=dtype), num_steps, 0.0, 1.0, config,
                comm=comm)
    message = None
except ValueError as err:
    message = str(err)
report(comm.rank, error=message)
comm.Barrier()
sys.exit(3 if message else 0)
