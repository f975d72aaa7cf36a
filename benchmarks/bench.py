"""Benchmarks: the reference workloads (docs/design.md, section 6), timed as ratios between
methods in one run.

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
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mgrit.app import launch
from mgrit.core.cycle import Result

from . import training as bench_train
from .timing import seconds
from .workloads import SOLVE_WORKLOADS, TRAINING_WORKLOADS, SolveWorkload


def run_serial(work: SolveWorkload, repeats: int) -> dict[str, Any]:
    """MGRIT in this process against sequential stepping, and against the solver itself
    with levels=1 (the same march mgrit's coarsest level takes), interleaved run by run."""
    result = work.solve()
    one_level = replace(work.config, levels=1, tol=0.0, max_iter=1)
    solve_times, seq_times, level1_times = [], [], []
    for _ in range(repeats):
        solve_times.append(seconds(work.solve))
        seq_times.append(seconds(work.sequential))
        level1_times.append(seconds(lambda: work.solve(config=one_level)))
    solve_s, seq_s = statistics.median(solve_times), statistics.median(seq_times)
    level1_s = statistics.median(level1_times)
    record = {
        "workload": work.name,
        "iterations": result.iterations,
        "residuals": result.residuals,
        "solve_seconds": solve_s,
        "sequential_seconds": seq_s,
        "ratio": solve_s / seq_s,
        "levels1_seconds": level1_s,
        "final_difference_to_sequential": float((result.final - work.sequential()).abs().max()),
        "repeats": repeats,
        "threads": torch.get_num_threads(),
    }
    if work.reference:
        record["reference_residuals"] = work.reference
        record["reference_max_relative_difference"] = max(
            abs(a - b) / b for a, b in zip(result.residuals, work.reference))
    return record


def run_worker(work: SolveWorkload, repeats: int) -> dict[str, Any] | None:
    """Under mpiexec: time the distributed solve (barrier to barrier). The record on rank
    0, None elsewhere."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    times: list[float] = []
    result: Result | None = None
    for _ in range(repeats + 1):  # the first run warms up and is not timed
        comm.Barrier()
        start = MPI.Wtime()
        result = work.solve(comm=comm)
        comm.Barrier()
        times.append(MPI.Wtime() - start)
    if comm.rank != 0:
        return None
    return {"workload": work.name, "ranks": comm.size, "iterations": result.iterations,
            "residuals": result.residuals, "solve_seconds": statistics.median(times[1:]),
            "repeats": repeats}


def launch_worker(name: str, ranks: int, repeats: int) -> dict[str, Any]:
    """Run the workload's worker under `mpiexec -n ranks`; return rank 0's record."""
    done = launch.run(ranks, ["-m", "benchmarks.bench", name, "--worker", "--repeats",
                              str(repeats)],
                      timeout=3600, env={"MGRIT_GLOO_PORT": str(launch.free_port())})
    return done.check().reports[0]


def run_ranks(name: str, ranks: list[int], repeats: int) -> list[dict[str, Any]]:
    """Launch the workload on each rank count; add efficiency T1/(P*TP) against the first."""
    records = [launch_worker(name, p, repeats) for p in ranks]
    base = records[0]
    for rec in records:
        speedup = base["solve_seconds"] / rec["solve_seconds"]
        rec["speedup"] = speedup
        rec["efficiency"] = speedup * base["ranks"] / rec["ranks"]
    return records


def print_serial(work: SolveWorkload, rec: dict[str, Any]) -> None:
    print(f"{work.name.upper()}: {work.description}")
    print(f"{'cycle':>5}  {'residual':>12}  {'reference':>12}  {'factor':>7}")
    prev = None
    for k, r in enumerate(rec["residuals"]):
        ref = f"{work.reference[k]:12.4e}" if k < len(work.reference) else f"{'-':>12}"
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


def print_ranks(work: SolveWorkload, serial: dict[str, Any], records: list[dict[str, Any]]
                ) -> None:
    print(f"{work.name.upper()} on several ranks (one thread each): {work.description}")
    print(f"{'ranks':>5}  {'cycles':>6}  {'solve ms':>10}  {'speedup':>7}  {'efficiency':>10}  "
          f"{'vs sequential':>13}")
    for rec in records:
        print(f"{rec['ranks']:>5}  {rec['iterations']:>6}  {rec['solve_seconds'] * 1e3:10.2f}  "
              f"{rec['speedup']:7.2f}  {rec['efficiency']:10.2f}  "
              f"{rec['solve_seconds'] / serial['sequential_seconds']:13.2f}")
    print(f"(sequential stepping in one process: {serial['sequential_seconds'] * 1e3:.2f} ms)")


ALL_WORKLOADS = sorted(SOLVE_WORKLOADS) + sorted(TRAINING_WORKLOADS) + ["w3"]
# one line each for --help; written out rather than built from the workloads, since building
# W4 or W5 reads a corpus or a data set (docs/design.md, section 6 has them in full)
WORKLOAD_HELP = {
    "w0": "Dahlquist u' = -u, N = 16384, 5 levels: residuals against PyMGRIT, solve vs "
          "sequential stepping",
    "heat": "heat equation, nx = 20001, N = 1024: a costly step, solve vs sequential "
            "stepping",
    "w1": "conv ResNet, 3 channels, N = 32, batch 50: training step and forward vs serial, "
          "layer-wise, GPipe",
    "w2": "dense tanh ResNet, width 32, N = 1024, batch 1: training step and forward",
    "w2b": "W2 with batch 32",
    "w3": "dense ResNet on the digits, N = 32: test accuracy, serial vs layer-parallel",
    "w4": "GPT-style character transformer, N = 32 blocks: training step and forward",
    "w5": "ViT on the 8x8 digits, N = 16 blocks: training step and forward",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workloads", nargs="+", choices=ALL_WORKLOADS, metavar="WORKLOAD",
                        help=f"workloads to run: {', '.join(ALL_WORKLOADS)}")
    parser.add_argument("--ranks", help="comma-separated rank counts, e.g. 1,2")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per method (median)")
    # under mpiexec, launched by launch_worker: run the first workload, report to the launcher
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


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
        record = (run_worker(SOLVE_WORKLOADS[name](), args.repeats) if name in SOLVE_WORKLOADS
                  else bench_train.worker(name, args.repeats))
        if record is not None:
            launch.report(record)
        return 0
    ranks = _parse_ranks(args.ranks) if args.ranks else None
    output: list[dict[str, Any]] = []
    for name in args.workloads:
        if name == "w3":
            records = bench_train.accuracy_records(ranks or [1], launch_worker)
            bench_train.print_accuracy(records)
            output.extend(records)
            print()
            continue
        if name in TRAINING_WORKLOADS:
            records = bench_train.timing_records(name, ranks or [1], args.repeats,
                                                   launch_worker)
            bench_train.print_timing(name, records)
            output.extend(records)
            print()
            continue
        work = SOLVE_WORKLOADS[name]()
        serial = run_serial(work, args.repeats)
        print_serial(work, serial)
        output.append(serial)
        if ranks:
            records = run_ranks(name, ranks, args.repeats)
            print()
            print_ranks(work, serial, records)
            output.extend(records)
        print()
    if args.json:
        data: Any = output[0] if len(output) == 1 else output
        Path(args.json).write_text(json.dumps(data, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """`mgrit bench`'s parser, its workloads listed one line each under --help."""
    parser = argparse.ArgumentParser(
        prog="mgrit bench", description=__doc__.split("\n\n")[0].replace("\n", " "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="workloads:\n" + "\n".join(f"  {name:<6}{WORKLOAD_HELP[name]}"
                                          for name in ALL_WORKLOADS))
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
