"""Rank 1 passes a different setting; every rank must get the error before any exchange."""

import sys

import torch
from mpi4py import MPI

import mgrit
from mgrit.app.launch import report
from mgrit.comm.mpi import MPIComm
from mgrit.problems import Dahlquist

comm = MPI.COMM_WORLD
what = sys.argv[1]
odd = comm.rank == 1


def attempt(work) -> None:
    """Run `work`, report the ValueError it raised (None if none) and exit: 3 if it raised."""
    try:
        work()
        message = None
    except ValueError as err:
        message = str(err)
    report({"error": message})
    comm.Barrier()
    sys.exit(3 if message else 0)


if what == "values":
    # equal values whose reprs differ agree; a value that differs on one rank does not
    mine = MPIComm(comm)
    mine.agree("equal values", (1.0, "a") if odd else (1, "a"))
    attempt(lambda: mine.agree("a batch shape", (3, 4) if odd else (3, 5)))
num_steps = 65 if (what == "num_steps" and odd) else 64
dtype = torch.float32 if (what == "dtype" and odd) else torch.float64
config = mgrit.Config(levels=3, relax="F" if (what == "config" and odd) else "FCF")
attempt(lambda: mgrit.solve(Dahlquist(-1.0), torch.tensor(1.0, dtype=dtype), num_steps, 0.0,
                            1.0, config, comm=comm))
