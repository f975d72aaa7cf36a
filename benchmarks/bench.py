"""Benchmarks: workloads of DESIGN.md section 6, timed as ratios between methods in one run.

    mgrit bench w0 [--json FILE] [--repeats R]
    mgrit bench w0 heat --ranks 1,2 [--json FILE]
    mgrit bench w1 w2 w3 --ranks 1,2

Without --ranks a workload runs in this process and its MGRIT solve is timed against
sequential stepping of the same propagator. With --ranks it is also launched under
`mpiexec -n P` for each P, and the table adds the parallel efficiency T1/(P*TP).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from mgrit.app.launch import _free_port, mpiexec
from mgrit.core.config import Config
from mgrit.core.cycle import Result, solve
from mgrit.core.propagator import Propagator, Step
from mgrit.problems import Dahlquist, Heat1D

from . import training as bench_train

# Residual history of W0 from an established MGRIT implementation (PyMGRIT), see
# docs/results.md; a correct solver reproduces it to about 1e-8 relative.
W0_REFERENCE = [2.5279539685028364e-02, 1.7930034195332422e-03, 1.6194919210368527e-04,
                1.5250703496904307e-05, 1.4712661282858573e-06, 1.4400735860047092e-07,
                1.4234196484315547e-08, 1.4167735802542508e-09, 1.4174687264778850e-10,
                1.4238166031588226e-11]


@dataclass
class Case:
    """One problem to time: a propagator, its grid and the solver settings."""

    name: str
    description: str
    prop: Propagator
    u0: torch.Tensor
    num_steps: int
    t0: float
    t1: float
    config: Config
    reference: list[float] = field(default_factory=list)


def w0_case() -> Case:
    return Case("w0", "u' = -u, backward Euler, h = 0.05, N = 16384, levels 5, m = 4, FCF, "
                "V-cycle, zero guess, tol 1e-10", Dahlquist(-1.0),
                torch.tensor(1.0, dtype=torch.float64), 16384, 0.0, 16384 * 0.05,
                Config(levels=5, coarsening=4, relax="FCF", cycle="V", initial_guess="zero",
                       tol=1e-10, max_iter=50), W0_REFERENCE)


def heat_case(nx: int = 20001, num_steps: int = 1024) -> Case:
    """A costly step: the heat equation on nx points, one tridiagonal solve per step."""

    prop = Heat1D.sine_solution(nx)
    return Case("heat", f"u_t = u_xx + b, nx = {nx}, N = {num_steps} on [0, 2], levels 4, m = 4, "
                "FCF, V-cycle, tol 1e-8", prop, prop.initial_sine(),
                num_steps, 0.0, 2.0,
                Config(levels=4, coarsening=4, relax="FCF", cycle="V", tol=1e-8, max_iter=50))


CASES: dict[str, Callable[[], Case]] = {"w0": w0_case, "heat": heat_case}


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def sequential(case: Case) -> torch.Tensor:
    """Plain time stepping of the case's propagator; returns the final state."""
    h = (case.t1 - case.t0) / case.num_steps
    u = case.u0
    for n in range(case.num_steps):
        u = case.prop.step(u, Step(0, n, n, case.t0 + n * h, h))
    return u


def run_serial(case: Case, repeats: int) -> dict[str, Any]:
    """MGRIT in this process against sequential stepping, and against the solver itself
    with levels=1 (the same march mgrit's coarsest level takes), interleaved run by run."""
    result = solve(case.prop, case.u0, case.num_steps, case.t0, case.t1, case.config)
    one_level = replace(case.config, levels=1, tol=0.0, max_iter=1)
    solve_times, seq_times, level1_times = [], [], []
    for _ in range(repeats):
        solve_times.append(_seconds(lambda: solve(case.prop, case.u0, case.num_steps, case.t0,
                                                  case.t1, case.config)))
        seq_times.append(_seconds(lambda: sequential(case)))
        level1_times.append(_seconds(lambda: solve(case.prop, case.u0, case.num_steps,
                                                   case.t0, case.t1, one_level)))
    solve_s, seq_s = statistics.median(solve_times), statistics.median(seq_times)
    level1_s = statistics.median(level1_times)
    record = {
        "workload": case.name,
        "iterations": result.iterations,
        "residuals": result.residuals,
        "solve_seconds": solve_s,
        "sequential_seconds": seq_s,
        "ratio": solve_s / seq_s,
        "levels1_seconds": level1_s,
        "final_difference_to_sequential": float((result.final - sequential(case)).abs().max()),
        "repeats": repeats,
        "threads": torch.get_num_threads(),
    }
    if case.reference:
        record["reference_residuals"] = case.reference
        record["reference_max_relative_difference"] = max(
            abs(a - b) / b for a, b in zip(result.residuals, case.reference))
    return record


def run_worker(case: Case, repeats: int, out: Path) -> None:
    """Under mpiexec: time the distributed solve (barrier to barrier); rank 0 writes JSON."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    times: list[float] = []
    result: Result | None = None
    for _ in range(repeats + 1):  # the first run warms up and is not timed
        comm.Barrier()
        start = MPI.Wtime()
        result = solve(case.prop, case.u0, case.num_steps, case.t0, case.t1, case.config,
                       comm=comm)
        comm.Barrier()
        times.append(MPI.Wtime() - start)
    if comm.rank == 0:
        out.write_text(json.dumps({"workload": case.name, "ranks": comm.size,
                                   "iterations": result.iterations,
                                   "residuals": result.residuals,
                                   "solve_seconds": statistics.median(times[1:]),
                                   "repeats": repeats}))


def launch(name: str, ranks: int, repeats: int) -> dict[str, Any]:
    """Run the workload's worker under `mpiexec -n ranks`; return what rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "benchmarks.bench",
               name, "--worker", str(out), "--repeats", str(repeats)]
        env = dict(os.environ, OMP_NUM_THREADS="1", MGRIT_GLOO_PORT=str(_free_port()))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
        return json.loads(out.read_text())


def run_ranks(name: str, ranks: list[int], repeats: int) -> list[dict[str, Any]]:
    """Launch the workload on each rank count; add efficiency T1/(P*TP) against the first."""
    records = [launch(name, p, repeats) for p in ranks]
    base = records[0]
    for rec in records:
        speedup = base["solve_seconds"] / rec["solve_seconds"]
        rec["speedup"] = speedup
        rec["efficiency"] = speedup * base["ranks"] / rec["ranks"]
    return records


def print_serial(case: Case, rec: dict[str, Any]) -> None:
    print(f"{case.name.upper()}: {case.description}")
    print(f"{'cycle':>5}  {'residual':>12}  {'reference':>12}  {'factor':>7}")
    prev = None
    for k, r in enumerate(rec["residuals"]):
        ref = f"{case.reference[k]:12.4e}" if k < len(case.reference) else f"{'-':>12}"
        factor = f"{r / prev:7.4f}" if prev else f"{'-':>7}"
        print(f"{k + 1:>5}  {r:12.4e}  {ref}  {factor}")
        prev = r
    print(f"iterations                  {rec['iterations']}")
    if "reference_max_relative_difference" in rec:
        print(f"max rel. diff. to reference {rec['reference_max_relative_difference']:.2e}")
    print(f"MGRIT solve                 {rec['solve_seconds'] * 1e3:10.2f} ms "
          f"(median of {rec['repeats']}, one process, one thread)")
    print(f"sequential stepping         {rec['sequential_seconds'] * 1e3:10.2f} ms "
          "(a loop over the propagator's step)")
    print(f"sequential, mgrit levels=1  {rec['levels1_seconds'] * 1e3:10.2f} ms "
          "(the solver's own march, same kernels)")
    print(f"ratio solve / sequential    {rec['ratio']:10.3f}")


def print_ranks(case: Case, serial: dict[str, Any], records: list[dict[str, Any]]) -> None:
    print(f"{case.name.upper()} on several ranks (one thread each): {case.description}")
    print(f"{'ranks':>5}  {'cycles':>6}  {'solve ms':>10}  {'speedup':>7}  {'efficiency':>10}  "
          f"{'vs sequential':>13}")
    for rec in records:
        print(f"{rec['ranks']:>5}  {rec['iterations']:>6}  {rec['solve_seconds'] * 1e3:10.2f}  "
              f"{rec['speedup']:7.2f}  {rec['efficiency']:10.2f}  "
              f"{rec['solve_seconds'] / serial['sequential_seconds']:13.2f}")
    print(f"(sequential stepping in one process: {serial['sequential_seconds'] * 1e3:.2f} ms)")


ALL_WORKLOADS = sorted(CASES) + sorted(bench_train.WORKLOADS) + ["w3"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workloads", nargs="+", choices=ALL_WORKLOADS, metavar="WORKLOAD",
                        help=f"workloads to run: {', '.join(ALL_WORKLOADS)}")
    parser.add_argument("--ranks", help="comma-separated rank counts, e.g. 1,2")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per method (median)")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)


def _parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(p) for p in text.split(",")]
    except ValueError:
        raise SystemExit(f"--ranks must be comma-separated integers, got {text!r}") from None
    if not ranks or min(ranks) < 1:
        raise SystemExit(f"--ranks must list rank counts >= 1, got {text!r}")
    return ranks


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    torch.set_num_threads(1)
    if args.worker:
        name = args.workloads[0]
        if name in CASES:
            run_worker(CASES[name](), args.repeats, Path(args.worker))
        else:
            bench_train.worker(name, args.repeats, Path(args.worker))
        return 0
    ranks = _parse_ranks(args.ranks) if args.ranks else None
    output: list[dict[str, Any]] = []
    for name in args.workloads:
        if name == "w3":
            records = bench_train.accuracy_records(ranks or [1], launch)
            bench_train.print_accuracy(records)
            output.extend(records)
            print()
            continue
        if name in bench_train.WORKLOADS:
            records = bench_train.timing_records(name, ranks or [1], args.repeats, launch)
            bench_train.print_timing(name, records)
            output.extend(records)
            print()
            continue
        case = CASES[name]()
        serial = run_serial(case, args.repeats)
        print_serial(case, serial)
        output.append(serial)
        if ranks:
            records = run_ranks(name, ranks, args.repeats)
            print()
            print_ranks(case, serial, records)
            output.extend(records)
        print()
    if args.json:
        data: Any = output[0] if len(output) == 1 else output
        Path(args.json).write_text(json.dumps(data, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mgrit bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
