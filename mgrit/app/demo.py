"""The project's main job for now: a parallel-in-time solve of the heat equation."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from ..core.config import Config
from ..core.cycle import solve
from ..core.propagator import step_sequentially
from ..problems import Heat1D


def heat_demo(nx: int = 257, num_steps: int = 4096, levels: int = 4, coarsening: int = 4,
              relax: str = "FCF", cycle: str = "V", tol: float = 1e-10, comm: Any = None) -> dict:
    """Solve u_t = u_xx + b on [0, 1] x [0, 2], exact solution sin(pi x) cos(t), with MGRIT
    (over the ranks of the mpi4py communicator `comm`, if given) and with sequential backward
    Euler in each process; report the residual history and the agreement."""
    prop = Heat1D.sine_solution(nx)
    u0 = prop.initial_sine()
    cfg = Config(levels=levels, coarsening=coarsening, relax=relax, cycle=cycle, tol=tol,
                 max_iter=50)
    if comm is not None:
        comm.Barrier()
    start = time.perf_counter()
    res = solve(prop, u0, num_steps, 0.0, 2.0, cfg, comm=comm)
    if comm is not None:
        comm.Barrier()
    solve_s = time.perf_counter() - start
    start = time.perf_counter()
    seq = step_sequentially(prop, u0, num_steps, 0.0, 2.0)
    seq_s = time.perf_counter() - start
    exact = prop.exact_sine(2.0)
    own = seq[res.first_index: res.first_index + len(res.states)]
    difference = float((res.states - own).abs().max()) if len(own) else 0.0
    if comm is not None:
        difference = comm.allreduce(difference, op=_mpi_max())
    return {
        "ranks": 1 if comm is None else comm.size,
        "residuals": res.residuals,
        "converged": res.converged,
        "levels": res.levels,
        "difference_to_sequential": difference,
        "error_to_exact": float((res.final - exact).abs().max()),
        "solve_seconds": solve_s,
        "sequential_seconds": seq_s,
        "settings": dict(nx=nx, num_steps=num_steps, levels=levels, coarsening=coarsening,
                         relax=relax, cycle=cycle, tol=tol),
    }


def _mpi_max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def print_heat(rec: dict) -> None:
    s = rec["settings"]
    print(f"Heat equation u_t = u_xx + b(x,t) on [0,1] x [0,2]: nx = {s['nx']}, "
          f"N = {s['num_steps']} backward Euler steps, time points over {rec['ranks']} rank(s)")
    print(f"MGRIT: {rec['levels']} levels, coarsening {s['coarsening']}, {s['relax']}-relaxation, "
          f"{s['cycle']}-cycles, tol {s['tol']:g}")
    print(f"{'cycle':>5}  {'residual':>12}  {'factor':>7}")
    prev = None
    for k, r in enumerate(rec["residuals"]):
        factor = f"{r / prev:7.4f}" if prev else "      -"
        print(f"{k + 1:>5}  {r:12.4e}  {factor}")
        prev = r
    print(f"converged: {rec['converged']}")
    print(f"max |MGRIT - sequential| over all points: {rec['difference_to_sequential']:.2e}")
    print(f"max |u(T) - exact solution|:               {rec['error_to_exact']:.2e}")
    print(f"time: MGRIT {rec['solve_seconds']:.2f} s on {rec['ranks']} rank(s), sequential "
          f"stepping {rec['sequential_seconds']:.2f} s in one process")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nx", type=int, default=257, help="spatial grid points")
    parser.add_argument("--steps", type=int, default=4096, help="time steps N")
    parser.add_argument("--levels", type=int, default=4)
    parser.add_argument("--coarsening", type=int, default=4)
    parser.add_argument("--relax", default="FCF")
    parser.add_argument("--cycle", default="V")


def run(args: argparse.Namespace) -> int:
    """Serial in a plain process; distributed when launched with mpiexec -n P (P > 1)."""
    torch.set_num_threads(1)  # concurrency comes from batching and ranks, not threads
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if MPI.COMM_WORLD.size > 1 else None
    rec = heat_demo(nx=args.nx, num_steps=args.steps, levels=args.levels,
                    coarsening=args.coarsening, relax=args.relax, cycle=args.cycle, comm=comm)
    if comm is None or comm.rank == 0:
        print_heat(rec)
    return 0
