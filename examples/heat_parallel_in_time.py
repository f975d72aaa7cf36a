"""The heat equation solved parallel in time, against sequential time stepping.

    python examples/heat_parallel_in_time.py
    mpiexec -n 4 python -m mpi4py examples/heat_parallel_in_time.py
"""

import torch
from mpi4py import MPI

import mgrit
from mgrit.problems import Heat1D

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
prop = Heat1D.sine_solution(nx=129)            # exact solution sin(pi x) cos(t)
u0 = prop.initial_sine()
config = mgrit.Config(levels=4, coarsening=4, relax="FCF", cycle="V", tol=1e-10)
result = mgrit.solve(prop, u0, 2048, 0.0, 2.0, config, comm=comm)

sequential = mgrit.step_sequentially(prop, u0, 2048, 0.0, 2.0)
mine = sequential[result.first_index: result.first_index + len(result.states)]
difference = comm.allreduce(float((result.states - mine).abs().max()), op=MPI.MAX)
if comm.rank == 0:
    for k, r in enumerate(result.residuals, 1):
        print(f"cycle {k:2d}  residual {r:.3e}")
    print(f"max |MGRIT - sequential| = {difference:.2e}; "
          f"error at t=2: {float((result.final - prop.exact_sine(2.0)).abs().max()):.2e}")
