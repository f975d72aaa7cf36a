"""One rank's propagator raises in the middle of a solve; every rank must end promptly."""

import sys

import torch
from mpi4py import MPI

import mgrit
from mgrit.app.launch import report
from mgrit.problems import Dahlquist

FAILING_RANK = int(sys.argv[1])


class Faulty(Dahlquist):
    def step_batch(self, states, steps):
        if MPI.COMM_WORLD.rank == FAILING_RANK and steps.level == 1:
            raise RuntimeError(f"deliberate failure on rank {FAILING_RANK}")
        return super().step_batch(states, steps)


mgrit.solve(Faulty(-1.0), torch.tensor(1.0, dtype=torch.float64), 4096, 0.0, 10.0,
            mgrit.Config(levels=3, coarsening=4, max_iter=20), comm=MPI.COMM_WORLD)
report({"finished": True})
