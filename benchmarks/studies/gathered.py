"""Coarse levels gathered on every rank (`Config.agglomerate`) against the solve that
passes them from rank to rank: W2's forward solve as a plain propagator (the dense tanh
ResNet of width 32, batch 1, float32, N = 1024, 4 levels, m = 4, F/FCF/FCF, 2 cycles) on
P virtual ranks, replayed on the study's cluster network. Per point: the predicted solve,
the hops on its critical path, and the communication floor (every compute span cut to
zero: the messages alone).

With `--training`, W2's training step as layer-parallel training runs it (native kernels,
`benchmarks.studies.nested`'s case) with the setting a gathered coarse level suits: 2
levels, m = 16, no cycle from nested starts, so that the coarse level is one point a rank
at 64 ranks and the whole solve is its one sweep and an F-relaxation. The forward solve
then fetches the coarse layers and the adjoint the forward states there (a reduction
each), and every rank sweeps the coarse level itself. Per round, in fresh processes:
sequential stepping and the setting measured on one rank, and the setting at P virtual
ranks, cold and warm, with the coarse level passed from rank to rank and gathered.

    python -m benchmarks.studies.gathered [--ranks 1,16,64] [--agglomerate 0,1,4]
    python -m benchmarks.studies.gathered --training [--ranks 64] [--rounds 3] [--json PATH]

Question: does gathering the coarse levels take hops off the path, and does it shorten the
step?
Answer: the plain propagator's solve: hops fall, the solve does not (docs/performance.md,
"Coarse levels"). W2's training step at 64 ranks: hops fall from 143 to 30 and the step
from 4.66 to 2.35 ms cold (3.85 to 1.35 warm), still 0.38x (0.67x) of sequential stepping
and slower than the chosen 3-level setting; docs/scaling.md, "Gathered coarse levels in
training", docs/results/gathered-training-64.json.
"""

from __future__ import annotations

import argparse
import json
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


# W2's training setting whose coarse level is gathered (`--training`): the forward's and
# the adjoint's options, as `benchmarks.training.hierarchy` records them
TRAINING = {"levels": 2, "coarsening": 16, "relax": ["F"], "max_iter": 0,
            "initial_guess": "nested"}


def training_options(agglomerate: int) -> dict[str, dict[str, Any]]:
    one = dict(TRAINING, agglomerate=agglomerate)
    return {"forward": one, "backward": dict(one)}


def training(ranks: int, rounds: int) -> dict[str, Any]:
    """W2's training step with `TRAINING` on one rank and predicted at `ranks` virtual
    ranks, its coarse level passed from rank to rank and gathered; every point the fastest
    of `rounds` rounds, each computation in a fresh process."""
    from ..scaling.virtual import fresh
    from .nested import PLAN, cold_and_warm, gradient_error, one_rank, work_of

    network = Interconnect(CLUSTER_LATENCY, CLUSTER_BANDWIDTH, OVERHEAD)
    measured: list[dict[str, float]] = []
    predicted: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for _ in range(rounds):
        measured.append(fresh(one_rank, "w2", training_options(0), PLAN["w2"][2],
                              PLAN["w2"][1]))
        for agg in predicted:
            predicted[agg].append(cold_and_warm("w2", training_options(agg), ranks, network))
    one = {k: min(m[k] for m in measured) for k in measured[0]}
    best = {agg: {kind: min((r[kind] for r in runs), key=lambda r: r["seconds"])
                  for kind in ("cold", "warm")} for agg, runs in predicted.items()}
    return {"ranks": ranks, "rounds": rounds, "options": TRAINING, "network": vars(network),
            "gradient_error": gradient_error(work_of("w2", training_options(0))),
            "measured_one_rank": one, "measured_rounds": measured,
            "predicted": {str(agg): b for agg, b in best.items()},
            "predicted_rounds": {str(agg): [{k: r[k]["seconds"] for k in r} for r in runs]
                                 for agg, runs in predicted.items()}}


def training_table(result: dict[str, Any]) -> str:
    seq = result["measured_one_rank"]["sequential"]
    lines = [f"sequential stepping, 1 rank: {seq * 1e3:.3f} ms; the setting (L2 m16 F 0/0 "
             f"nested), 1 rank: {result['measured_one_rank']['chosen'] * 1e3:.3f} ms; "
             f"gradient error {result['gradient_error']:.3f}", "",
             f"| coarse level at {result['ranks']} ranks | cold (warm) | hops | busy mean | "
             "vs sequential: cold (warm) |", "| --- | ---: | ---: | ---: | ---: |"]
    for agg, label in (("0", "passed from rank to rank"), ("1", "gathered")):
        cold, warm = result["predicted"][agg]["cold"], result["predicted"][agg]["warm"]
        lines.append(f"| {label} | {cold['seconds'] * 1e3:.2f} ({warm['seconds'] * 1e3:.2f}) ms "
                     f"| {cold['critical']['hops']} | {cold['busy_mean'] * 1e3:.2f} ms | "
                     f"{seq / cold['seconds']:.2f} ({seq / warm['seconds']:.2f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default=None, help="default 1,16,64; 64 with --training")
    parser.add_argument("--agglomerate", default="0,1,4")
    parser.add_argument("--training", action="store_true",
                        help="W2's training step with a gathered coarse level")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="with --training: also write the result here")
    args = parser.parse_args(argv)
    if args.training:
        torch.set_num_threads(1)
        result = training(int(args.ranks or 64), args.rounds)
        print(training_table(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    args.ranks = args.ranks or "1,16,64"
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
