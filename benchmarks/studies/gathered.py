"""Coarse levels gathered on every rank (`Config.agglomerate`) against the solve that
passes them from rank to rank: W2's forward solve as a plain propagator (the dense tanh
ResNet of width 32, batch 1, float32, N = 1024, 4 levels, m = 4, F/FCF/FCF, 2 cycles) on
P virtual ranks, replayed on the study's cluster network. Per point: the predicted solve,
the hops on its critical path, and the communication floor (every compute span cut to
zero: the messages alone). Layer-parallel training refuses the option (its steps need
their own rank's layers and forward states), so the training step itself is not measured.

    python -m benchmarks.studies.gathered [--ranks 1,16,64] [--agglomerate 0,1,4]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import mgrit
from mgrit.app.replay import Interconnect, replay
from mgrit.comm.tracing import Tracer, TracingComm
from mgrit.comm.virtual import run_ranks
from mgrit.problems import DenseResNet

from .hops import OVERHEAD
from ..scaling.study import CLUSTER_BANDWIDTH, CLUSTER_LATENCY


def problem(num_steps: int = 1024) -> tuple[DenseResNet, torch.Tensor]:
    prop = DenseResNet.random(num_steps, 32, seed=1, dtype=torch.float32)
    return prop, torch.randn(1, 32, generator=torch.Generator().manual_seed(1))


def config(agglomerate: int, levels: int = 4) -> mgrit.Config:
    return mgrit.Config(levels=levels, coarsening=4, relax=("F", "FCF", "FCF")[:levels - 1]
                        if levels > 1 else "F", max_iter=2, tol=0.0, min_coarse=1,
                        agglomerate=agglomerate)


def traces(ranks: int, agglomerate: int, num_steps: int = 1024, warmup: int = 3,
           repeats: int = 3) -> list[list[list[Any]]]:
    """[repeat][rank] traces of the forward solve after `warmup` untraced ones."""
    prop, u0 = problem(num_steps)
    cfg = config(agglomerate)

    def program(comm: Any) -> list[list[Any]]:
        tracer = Tracer(time.thread_time)
        solver = mgrit.Solver(prop, u0, num_steps, 0.0, 1.0, cfg, TracingComm(comm, tracer))
        out = []
        for k in range(warmup + repeats):
            tracer.start()
            solver.solve(u0)
            events = tracer.stop()
            if k >= warmup:
                out.append(events)
        return out
    per_rank = [program(mgrit.comm.SerialComm())] if ranks == 1 else run_ranks(ranks, program)
    return [[r[k] for r in per_rank] for k in range(repeats)]


def point(ranks: int, agglomerate: int, network: Interconnect, num_steps: int = 1024
          ) -> dict[str, Any]:
    """The fastest repeat's prediction, its path's hops and its communication floor."""
    best = None
    for t in traces(ranks, agglomerate, num_steps):
        pred = replay(t, network)
        cut = [[["compute", 0.0] if e[0] == "compute" else e for e in rank] for rank in t]
        row = {"ranks": ranks, "agglomerate": agglomerate, "predicted": pred.total,
               "hops": pred.critical["hops"], "floor": replay(cut, network).total}
        if best is None or row["predicted"] < best["predicted"]:
            best = row
    assert best is not None
    return best


def sequential(num_steps: int = 1024, rounds: int = 10) -> float:
    """mgrit's own sequential stepping (levels = 1) of the same problem, fastest round."""
    prop, u0 = problem(num_steps)
    solver = mgrit.Solver(prop, u0, num_steps, 0.0, 1.0, config(0, levels=1))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        solver.solve(u0)
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,16,64")
    parser.add_argument("--agglomerate", default="0,1,4")
    args = parser.parse_args(argv)
    try:
        ranks = [int(p) for p in args.ranks.split(",")]
        aggs = [int(p) for p in args.agglomerate.split(",")]
    except ValueError:
        raise SystemExit("--ranks and --agglomerate must be comma-separated integers")
    if not ranks or min(ranks) < 1 or not aggs or min(aggs) < 0:
        raise SystemExit("--ranks must list counts >= 1 and --agglomerate values >= 0")
    torch.set_num_threads(1)
    network = Interconnect(CLUSTER_LATENCY, CLUSTER_BANDWIDTH, OVERHEAD)
    seq = sequential()
    # this propagator marches step by step in Python: its own sequential stepping is far
    # from the strongest sequential code of W2 (the native kernels' levels=1 march)
    print(f"this propagator's sequential stepping (levels=1), 1 rank: {seq * 1e3:.3f} ms")
    print("| ranks | agglomerate | predicted ms | hops on path | communication floor ms |\n"
          "| ---: | ---: | ---: | ---: | ---: |")
    for p in ranks:
        for agg in (aggs if p > 1 else [0]):
            r = point(p, agg, network)
            print(f"| {p} | {agg} | {r['predicted'] * 1e3:.3f} | {r['hops']} | "
                  f"{r['floor'] * 1e3:.3f} |", flush=True)


if __name__ == "__main__":
    main()
