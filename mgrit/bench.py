"""Benchmarks: workloads of DESIGN.md section 6, timed as ratios between methods in one run.

    python -m mgrit.bench w0 [--json FILE] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

from .config import Config
from .cycle import solve
from .problems import Dahlquist
from .propagator import Step

# Residual history of W0 from an established MGRIT implementation (PyMGRIT), see
# docs/results.md; a correct solver reproduces it to about 1e-8 relative.
W0_REFERENCE = [2.5279539685028364e-02, 1.7930034195332422e-03, 1.6194919210368527e-04,
                1.5250703496904307e-05, 1.4712661282858573e-06, 1.4400735860047092e-07,
                1.4234196484315547e-08, 1.4167735802542508e-09, 1.4174687264778850e-10,
                1.4238166031588226e-11]


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_w0(repeats: int = 5) -> dict:
    """W0: u' = -u, backward Euler, h = 0.05, N = 16384, 5 levels, m = 4, FCF, V, zero guess."""
    prop = Dahlquist(-1.0)
    u0 = torch.tensor(1.0, dtype=torch.float64)
    num_steps, h = 16384, 0.05
    t1 = num_steps * h
    cfg = Config(levels=5, coarsening=4, relax="FCF", cycle="V", initial_guess="zero",
                 tol=1e-10, max_iter=50)

    def sequential() -> torch.Tensor:
        u = u0
        for n in range(num_steps):
            u = prop.step(u, Step(0, n, n, n * h, h))
        return u

    result = solve(prop, u0, num_steps, 0.0, t1, cfg)
    solve_times, seq_times = [], []
    for _ in range(repeats):  # interleaved, so both sides see the same machine state
        solve_times.append(_seconds(lambda: solve(prop, u0, num_steps, 0.0, t1, cfg)))
        seq_times.append(_seconds(sequential))
    solve_s, seq_s = statistics.median(solve_times), statistics.median(seq_times)
    agreement = max(abs(a - b) / b for a, b in zip(result.residuals, W0_REFERENCE))
    return {
        "workload": "w0",
        "iterations": result.iterations,
        "residuals": result.residuals,
        "solve_seconds": solve_s,
        "sequential_seconds": seq_s,
        "ratio": solve_s / seq_s,
        "reference_residuals": W0_REFERENCE,
        "reference_max_relative_difference": agreement,
        "final_error_vs_sequential": abs(float(result.final) - float(sequential())),
        "repeats": repeats,
        "threads": torch.get_num_threads(),
    }


def print_w0(rec: dict) -> None:
    print("W0: u' = -u, backward Euler, h = 0.05, N = 16384, levels 5, m = 4, FCF, V-cycle")
    print(f"{'cycle':>5}  {'residual':>12}  {'reference':>12}  {'factor':>7}")
    prev = None
    for k, r in enumerate(rec["residuals"]):
        ref = rec["reference_residuals"][k] if k < len(rec["reference_residuals"]) else float("nan")
        factor = f"{r / prev:7.4f}" if prev else "      -"
        print(f"{k + 1:>5}  {r:12.4e}  {ref:12.4e}  {factor}")
        prev = r
    print(f"iterations                 {rec['iterations']}")
    print(f"max rel. diff. to reference {rec['reference_max_relative_difference']:.2e}")
    print(f"MGRIT solve                {rec['solve_seconds'] * 1e3:9.2f} ms  (median of {rec['repeats']})")
    print(f"sequential stepping        {rec['sequential_seconds'] * 1e3:9.2f} ms")
    print(f"ratio solve / sequential   {rec['ratio']:9.3f}")


WORKLOADS = {"w0": (run_w0, print_w0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mgrit bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", choices=sorted(WORKLOADS), help="workload of DESIGN.md section 6")
    parser.add_argument("--json", metavar="FILE", help="also write the record as JSON")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per method (median)")


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    torch.set_num_threads(1)
    runner, printer = WORKLOADS[args.workload]
    record = runner(repeats=args.repeats)
    printer(record)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(record, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
