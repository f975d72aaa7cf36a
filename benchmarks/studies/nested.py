"""W2 and W1-1024 at P virtual ranks with the settings `mgrit.nn.choose_settings` picks for
P ranks under a gradient-error threshold (fewer cycles, nested starts: the coarse levels'
solution F-relaxed once where no cycle runs), against mgrit's own sequential stepping
(levels=1, the same native kernels) measured on one rank; and the model checked for those
settings against real MPI runs on 1 and 2 ranks.

    python -m benchmarks.studies.nested [--cases w2,w1-1024] [--ranks 64] [--threshold 0.25]
                                        [--json PATH]

Per case: the choice on the real one-process model (`choose_settings(model, closure,
ranks=P, threshold=...)`) and the chosen setting's gradient error against exact stepping on
the case's batch; then in rounds (`PLAN`; each point its fastest round): training steps
measured on one rank, sequential stepping's and the chosen setting's, each back to back;
MPI launches of the chosen setting on 1 and 2 ranks (measured, and their own traces
replayed on the network their ping-pong measured); virtual-rank predictions, cold and warm
(`benchmarks.studies.warm`), of those runs, of sequential stepping on one rank and of P
ranks on the study's cluster network. Every computation uses the environment's kernels (by
default mgrit's native ones, convolutions included: nothing is charged from a table), each
virtual run in a fresh process.

Question: with the chosen settings, does the model predict W1-1024 at 64 ranks at least 6x
and W2 at least 2x faster than their own sequential stepping?
Answer: W1-1024 yes, 8.8-13.0x cold or warm over four runs (2 levels, m = 16, no cycle from
nested starts; gradient error 0.126); W2 no, 0.38-1.03x (3 levels, m = 8, 1/1 cycles; 0.081):
sequential stepping through a rank's 16 layers alone takes 0.47 of the 0.73 ms that 2x
allows, and the setting's 60 hops take 0.32 ms more. Validated within 20% on 1 and 2 ranks.
Results: docs/results/nested-64.json; docs/scaling.md, "Chosen settings at 64 ranks".
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from mgrit.app import launch
from mgrit.app.replay import Interconnect
from mgrit.comm.mpi import MPIComm
from mgrit.comm.tracing import Tracer, TracingComm
from mgrit.nn import choose_settings, gradient_agreement
from mgrit.nn.controller.probe import EXACT, probe_solves

from ..scaling.cases import CURVES, fastest, setup, shared_model, traced_step
from ..scaling.study import CLUSTER_BANDWIDTH, CLUSTER_LATENCY
from ..scaling.validation import compare, network_from, ping_pong
from ..scaling.virtual import fresh, predict, work_traces
from ..training import (hierarchy, hierarchy_label, parallel_model, sequential_variant,
                        train_step_fn, with_hierarchy)
from ..workloads import TrainingWorkload
from . import warm

log = logging.getLogger(__name__)

# the cases, at their own depth (1024 layers each)
CASES = {"w2": CURVES["w2"], "w1-1024": CURVES["w1-1024"]}
# per case: (repeats, warm-up steps) of a virtual run; timed steps on one rank; repeats of
# an MPI launch; rounds (each: the one-rank steps, a launch on 1 and on 2 ranks, a virtual
# run of every point, each in a fresh process; a point's time is its fastest round, since
# the shared machine's slow phases last minutes and double a step). A W1-1024 step computes
# 1024 convolution layers, long enough that one warm-up step settles it.
PLAN = {"w2": (3, 3, 20, 5, 3), "w1-1024": (2, 1, 3, 2, 2)}

Options = dict[str, dict[str, Any]]


def work_of(name: str, options: Options | None = None) -> TrainingWorkload:
    """The case's training workload, with the hierarchy `options` (`training.hierarchy`)."""
    if name not in CASES:
        raise ValueError(f"unknown case {name!r}; choose from {', '.join(CASES)}")
    work = CASES[name].work()
    return work if options is None else with_hierarchy(work, options)


def gradient_error(work: TrainingWorkload) -> float:
    """The relative error of the training gradient with `work`'s solver options against
    exact stepping's, on the workload's batch and initial weights."""
    model = parallel_model(work)
    x, y = work.inputs(torch.Generator().manual_seed(1))
    closure = lambda: work.loss(model(x), y)  # noqa: E731
    exact, _, _ = probe_solves(model, closure, EXACT, EXACT)
    chosen, _, _ = probe_solves(model, closure, work.forward, work.backward)
    return gradient_agreement(model, chosen, exact)["overall"]["relative_error"]


def choose(name: str, ranks: int, threshold: float) -> dict[str, Any]:
    """The options `choose_settings` picks for the case's model (one process) priced for
    `ranks` ranks, with their gradient error and the seconds the choice took."""
    work = work_of(name)
    model = parallel_model(work)
    x, y = work.inputs(torch.Generator().manual_seed(1))
    start = time.perf_counter()
    forward, backward = choose_settings(model, lambda: work.loss(model(x), y), ranks=ranks,
                                        threshold=threshold, exact_passes=False)
    seconds = time.perf_counter() - start
    options = hierarchy(replace(work, forward=forward, backward=backward))
    return {"options": options, "label": hierarchy_label(options), "choice_seconds": seconds,
            "gradient_error": gradient_error(work_of(name, options))}


def share_layers(name: str, ranks: int) -> int:
    """The layers of the rank that holds the most of the case's network on `ranks` ranks."""
    return -(-CASES[name].num_steps // ranks)


def share_work(name: str, ranks: int) -> TrainingWorkload:
    """Sequential stepping through a rank's share of the case's layers at `ranks` ranks."""
    return sequential_variant(CASES[name].work(num_steps=share_layers(name, ranks)))


def one_rank(name: str, options: Options, repeats: int, warmup: int, ranks: int
             ) -> dict[str, float]:
    """Measured training steps on one rank of sequential stepping, of the chosen setting
    and (`share`) of sequential stepping through a rank's share of the layers at `ranks`
    ranks, the same network cut to `share_layers`: what a step on `ranks` ranks would take
    with no MGRIT work and no message, as every step's fixed costs (the passes' set-up,
    the loss, autograd, the update) stay. Each `repeats` steps back to back after `warmup`
    (fastest of them), one model after another. Steps of another model in between would
    evict this one's weights and states from the caches: W2's chosen step takes 1.7x as
    long so."""
    torch.set_num_threads(1)
    work = work_of(name, options)
    x, y = work.inputs(torch.Generator().manual_seed(1))
    out = {}
    for label, w in (("sequential", sequential_variant(work)), ("chosen", work),
                     ("share", share_work(name, ranks))):
        out[label] = fastest(_timed(train_step_fn(parallel_model(w), w, x, y), repeats, warmup))
    return out


def _timed(step: Any, repeats: int, warmup: int, barrier: Any = None) -> list[float]:
    """Seconds of `repeats` calls of `step` back to back after `warmup` (each from
    `barrier()`, if given, to the last rank's end)."""
    times = []
    for k in range(warmup + repeats):
        if barrier is not None:
            barrier.Barrier()
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        if barrier is not None:
            from mpi4py import MPI
            elapsed = barrier.allreduce(elapsed, op=MPI.MAX)
        if k >= warmup:
            times.append(elapsed)
    return times


def virtual(name: str, options: Options, ranks: int, network: Interconnect, hot: bool
            ) -> dict[str, Any]:
    """The virtual-rank prediction of a training step with `options` in this process
    (`virtual.fresh` gives a clean one): cold (the ranks taking turns on one core, each
    finding the others' data in cache: the conservative bound) or, with `hot`, warm (each
    rank's compute timed again alone, `benchmarks.studies.warm`: the optimistic one). The
    cold traces come from a plain virtual run: the warm tool's run also keeps a copy of
    every message received, and its cold W1-1024 step at 64 ranks read 120 ms where plain
    virtual runs read 76-80 ms."""
    torch.set_num_threads(1)
    repeats, warmup = PLAN[name][:2]
    work = work_of(name, options)
    traces = (warm.traces(work, ranks, repeats, warmup)[1] if hot else
              work_traces(work, ranks, repeats, warmup))
    return predict(traces, network)


def cold_and_warm(name: str, options: Options, ranks: int, network: Interconnect
          ) -> dict[str, dict[str, Any]]:
    """Cold and warm predictions, each from a fresh process."""
    return {kind: fresh(virtual, name, options, ranks, network, kind == "warm")
            for kind in ("cold", "warm")}


def worker(name: str, options: Options, repeats: int) -> None:
    """Under mpiexec: measured and traced training steps with `options` (and the
    ping-pong on 2 ranks), as `validation.validation_record` records them."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    tracer = Tracer()
    record: dict[str, Any] = {"ranks": world.size}
    if world.size >= 2:
        record["ping_pong"] = ping_pong(MPIComm(world))
    work = work_of(name, options)
    net, layers, x, y = setup(work)
    plain = shared_model(work, net, layers, world)
    traced = shared_model(work, net, layers, TracingComm(MPIComm(world), tracer))
    # the plain steps back to back, then the traced ones, as `one_rank` and the virtual
    # ranks run theirs (alternated, each would start with the other model's data in cache)
    warmup = PLAN[name][1]
    measured = _timed(traced_step(plain, work, x, y), repeats, warmup, world)
    step = traced_step(traced, work, x, y)
    for _ in range(warmup):
        step()
    traces = []
    for _ in range(repeats):
        world.Barrier()
        tracer.start()
        step()
        traces.append(tracer.stop())
    gathered = world.gather(traces, root=0)
    record[name] = {"train": {"measured": measured, "traces": None if gathered is None else
                              [[gathered[r][k] for r in range(world.size)]
                               for k in range(repeats)]}}
    if world.rank == 0:
        launch.report(record)


def _launch(name: str, options: Options, ranks: int) -> dict[str, Any]:
    done = launch.run(ranks, ["-m", "benchmarks.studies.nested", "--worker", name,
                              "--options", json.dumps(options), "--repeats",
                              str(PLAN[name][3])], timeout=1500)
    return done.check().reports[0]


def study(name: str, ranks: int, threshold: float) -> dict[str, Any]:
    """Everything the case's section reports (see the module's docstring): the choice, and
    per point the fastest of the rounds."""
    chosen = choose(name, ranks, threshold)
    log.info("%s: chose %s (gradient error %.3f, %.0f s)", name, chosen["label"],
             chosen["gradient_error"], chosen["choice_seconds"])
    options = chosen["options"]
    sequential = hierarchy(sequential_variant(work_of(name)))
    measured: list[dict[str, float]] = []
    records: dict[int, dict[str, Any]] = {}
    predicted: dict[str, list[dict[str, Any]]] = {"1": [], "2": [], str(ranks): [],
                                                  "sequential": []}
    network = cluster = None
    for round_ in range(PLAN[name][4]):
        measured.append(fresh(one_rank, name, options, PLAN[name][2], PLAN[name][1],
                                   ranks))
        for p in (1, 2):
            record = _launch(name, options, p)
            if p in records:        # every launch's repeats, for the fastest
                for key in ("measured", "traces"):
                    records[p][name]["train"][key] += record[name]["train"][key]
            else:
                records[p] = record
        if network is None:         # the network of the first 2-rank ping-pong
            network = network_from(records[2]["ping_pong"])
            cluster = Interconnect(CLUSTER_LATENCY, CLUSTER_BANDWIDTH, network.overhead)
        for p in (1, 2):
            predicted[str(p)].append(cold_and_warm(name, options, p, network))
        predicted[str(ranks)].append(cold_and_warm(name, options, ranks, cluster))
        predicted["sequential"].append(cold_and_warm(name, sequential, 1, cluster))
        log.info("%s, round %d: measured on 1 rank %s; predicted at %d ranks %.2f ms", name,
                 round_, {k: round(v * 1e3, 2) for k, v in measured[-1].items()}, ranks,
                 predicted[str(ranks)][-1]["cold"]["seconds"] * 1e3)
    best = {kind: {k: min((r[kind] for r in v), key=lambda r: r["seconds"])
                   for k, v in predicted.items()} for kind in ("cold", "warm")}
    one = {k: fastest(m[k] for m in measured) for k in measured[0]}
    rows = compare(records[1], network) + compare(records[2], network)
    for row in rows:
        for kind, label in (("cold", "virtual"), ("warm", "warm")):
            pred = best[kind][str(row["ranks"])]["seconds"]
            row.update({f"predicted_{label}": pred, f"{label}_error": pred / row["measured"] - 1})
    at = str(ranks)
    return {"case": name, "ranks": ranks, "threshold": threshold, **chosen,
            "measured_one_rank": one, "measured_one_rank_rounds": measured,
            "ping_pong": records[2]["ping_pong"], "validation": rows,
            "network": vars(cluster), "predicted": best["cold"][at],
            "predicted_warm": best["warm"][at],
            "predicted_sequential_one_rank": best["cold"]["sequential"],
            "predicted_rounds": {k: [{kind: r[kind]["seconds"] for kind in r} for r in v]
                                 for k, v in predicted.items()},
            "speedup_vs_sequential": one["sequential"] / best["cold"][at]["seconds"],
            "speedup_vs_sequential_warm": one["sequential"] / best["warm"][at]["seconds"],
            # what every step's fixed costs leave: a rank's share stepped with no MGRIT work
            # and no message, and the time that twice sequential stepping's speed leaves
            # for both on top of it
            "share_layers": share_layers(name, ranks),
            "bound_vs_sequential": one["sequential"] / one["share"],
            "room_at_2x": one["sequential"] / 2 - one["share"],
            "predicted_speedup_vs_sequential": (best["cold"]["sequential"]["seconds"]
                                                / best["cold"][at]["seconds"])}


def table(results: list[dict[str, Any]]) -> str:
    out = ["| case | setting | gradient error | sequential, 1 rank | chosen, 1 rank | "
           "P ranks, cold (warm) | hops | vs sequential, cold (warm) | "
           "a rank's share, sequential: step (bound) | "
           "validation, 1 and 2 ranks: cold (warm) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        errors = ", ".join(f"{row['virtual_error']:+.1%} ({row['warm_error']:+.1%})"
                           for row in r["validation"])
        out.append(f"| {r['case']} | {r['label']} | {r['gradient_error']:.3f} | "
                   f"{r['measured_one_rank']['sequential'] * 1e3:.2f} ms | "
                   f"{r['measured_one_rank']['chosen'] * 1e3:.2f} ms | "
                   f"{r['ranks']}: {r['predicted']['seconds'] * 1e3:.2f} ms "
                   f"({r['predicted_warm']['seconds'] * 1e3:.2f} ms) | "
                   f"{r['predicted']['critical']['hops']} | "
                   f"**{r['speedup_vs_sequential']:.2f}** "
                   f"({r['speedup_vs_sequential_warm']:.2f}) | "
                   f"{r['share_layers']} layers: "
                   f"{r['measured_one_rank']['share'] * 1e3:.2f} ms "
                   f"({r['bound_vs_sequential']:.1f}x) | {errors} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.nested",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--threshold", type=float, default=0.25)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", metavar="CASE", help=argparse.SUPPRESS)
    parser.add_argument("--options", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, json.loads(args.options), args.repeats)
        return
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    if args.ranks < 1 or not args.threshold > 0:
        parser.error(f"--ranks must be >= 1 and --threshold > 0, got {args.ranks} and "
                     f"{args.threshold}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    results = [study(n, args.ranks, args.threshold) for n in names]
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "argv": sys.argv[1:],
                       "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
