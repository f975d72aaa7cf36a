"""A tied step factory on several ranks: every rank refuses it, none waits for another."""

import torch
from mpi4py import MPI
from torch import nn

import mgrit
from mgrit.app.launch import report

torch.set_num_threads(1)
block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
try:
    mgrit.LayerParallel(lambda: block, 7, comm=MPI.COMM_WORLD,
                        forward=mgrit.Config(levels=1), backward=mgrit.Config(levels=1))
    error = None
except ValueError as err:
    error = str(err)
report({"error": error})
