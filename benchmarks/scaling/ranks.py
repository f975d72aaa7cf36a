"""The scaling model against real MPI ranks past two: W2 and W1 training steps (and no-grad
forwards) under `mpiexec -n P`, one thread per rank and never more ranks than cores, next
to serial PyTorch and layer-wise model parallelism measured in the same launch; each run's
own traces replayed, and the virtual-rank model's prediction for the same P.

    python -m benchmarks.scaling.ranks OUT_DIR [--ranks 1,2,4,8,16] [--repeats 5]
        writes OUT_DIR/ranks.json and prints the table (docs/scaling.md, "Real ranks")
    python -m benchmarks.scaling.ranks OUT_DIR --predict RANKS_JSON | --replay RANKS_JSON
        the predictions for an earlier run's measurements: both models on the machine that
        measured them, or the replays of its traces alone on any machine
    mpiexec -n P python -m mpi4py -m benchmarks.scaling.ranks --worker
        one launch; rank 0 reports its record

The network of every replay is the one the ping-pong between ranks 0 and 1 measured in the
2-rank launch (each launch's own where there is none). Virtual-rank predictions run in
fresh processes side by side, after all MPI launches, each charged its thread's CPU time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from mgrit.app import launch
from mgrit.app.replay import Interconnect

from ..baselines import LayerwiseModelParallel
from ..training import forward_fn, serial_network, train_step_fn
from .cases import CHECKS, ScalingCase, fastest, torch_kernels
from .validation import compare, network_from, validation_record
from .virtual import _fastest, virtual_point

log = logging.getLogger(__name__)

CASES = ("w2", "w1")
RANKS = (1, 2, 4, 8, 16)


def _times(world: Any, fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of `repeats` runs of fn on every rank (from a barrier to the last rank's
    end), after one that warms up."""
    from mpi4py import MPI

    times = []
    for k in range(repeats + 1):
        world.Barrier()
        start = time.perf_counter()
        fn()
        elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if k:
            times.append(elapsed)
    return times


def baselines_record(cases: tuple[str, ...], repeats: int) -> dict[str, Any]:
    """Under mpiexec: serial PyTorch on rank 0 alone (the others wait) and layer-wise model
    parallelism over all ranks, training step and forward, for every case."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    out: dict[str, Any] = {}
    for name in cases:
        work = CHECKS[name].work()
        x, y = work.inputs(torch.Generator().manual_seed(1))
        network = serial_network(work)
        layerwise = LayerwiseModelParallel(network, world, x, work.loss, work.optimizer)
        out[name] = {"layer-wise model parallel": {
            "train": _times(world, lambda: layerwise.train_step(x, y), repeats),
            "forward": _times(world, lambda: layerwise.forward(x), repeats)}}
        serial: dict[str, list[float]] = {}
        if world.rank == 0:
            network = serial_network(work)
            for metric, fn in (("train", train_step_fn(network, work, x, y)),
                               ("forward", forward_fn(network, x))):
                fn()
                serial[metric] = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    fn()
                    serial[metric].append(time.perf_counter() - start)
        world.Barrier()
        out[name]["serial pytorch"] = serial
    return out


def worker(cases: tuple[str, ...], repeats: int) -> None:
    torch.set_num_threads(1)
    record = {"mgrit": validation_record(cases, repeats),
              "baselines": baselines_record(cases, repeats)}
    from mpi4py import MPI

    if MPI.COMM_WORLD.rank == 0:
        launch.report(record)


def measure(ranks: list[int], cases: tuple[str, ...], repeats: int, timeout: float,
            save: Callable[[dict[int, dict[str, Any]]], None] | None = None
            ) -> dict[int, dict[str, Any]]:
    """One launch per rank count; rank counts above the machine's cores are left out (an
    oversubscribed core would measure the operating system's scheduler). `save` gets the
    records after every rank count, so that a run cut off keeps the counts measured."""
    records = {}
    for p in ranks:
        if p > (os.cpu_count() or 1):
            log.warning("%d ranks left out: this machine has %s cores", p, os.cpu_count())
            continue
        start = time.perf_counter()
        done = launch.run(p, ["-m", "benchmarks.scaling.ranks", "--worker", "--cases",
                              ",".join(cases), "--repeats", str(repeats)], timeout=timeout)
        records[p] = done.check().reports[0]
        log.info("%d ranks measured (%.0f s)", p, time.perf_counter() - start)
        if save is not None:
            save(records)
    return records


def _virtual(case: ScalingCase, ranks: int, network: Interconnect) -> dict[str, Any]:
    torch.set_num_threads(1)
    with torch_kernels():
        return virtual_point(case, ranks, {"": network})


def virtual_predictions(jobs: list[tuple[str, int]], network: Interconnect, workers: int,
                        processes: int | None = None
                        ) -> dict[tuple[str, int], dict[str, Any]]:
    """The fastest virtual-rank prediction of each (case, ranks) job over `processes` runs
    (default: the case's own count), each run in a fresh process, `workers` of them at a
    time."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context,
                                                max_tasks_per_child=1) as pool:
        futures = {job: [pool.submit(_virtual, CHECKS[job[0]], job[1], network)
                         for _ in range(processes or CHECKS[job[0]].processes)]
                   for job in jobs}
        out = {}
        for job, runs in futures.items():
            start = time.perf_counter()
            out[job] = _fastest([f.result() for f in runs], {"": network})["predictions"][""]
            log.info("virtual ranks: %s on %d ranks predicted (waited %.0f s)", *job,
                     time.perf_counter() - start)
        return out


def table(records: dict[int, dict[str, Any]], network: Interconnect, workers: int,
          processes: int | None = None, virtual: bool = True) -> list[dict[str, Any]]:
    """Per case, metric and rank count: measured MGRIT against the replay of its own traces
    and (unless `virtual` is false) against the virtual-rank model, and the measured
    baselines and speedups."""
    rows = []
    for p, record in records.items():
        rows += compare(record["mgrit"], network)
    jobs = sorted({(r["case"], r["ranks"]) for r in rows})
    predicted = virtual_predictions(jobs, network, workers, processes) if virtual else {}
    one = {(r["case"], r["metric"]): r["measured"] for r in rows if r["ranks"] == 1}
    for row in rows:
        p, case, metric = row["ranks"], row["case"], row["metric"]
        if predicted:
            pred = predicted[(case, p)]
            row["predicted_virtual"] = pred["seconds" if metric == "train" else
                                            "forward_seconds"]
            row["virtual_error"] = row["predicted_virtual"] / row["measured"] - 1.0
        base = records[p]["baselines"][case]
        serial = fastest(base["serial pytorch"][metric])
        layerwise = fastest(base["layer-wise model parallel"][metric])
        row.update({"serial": serial, "layerwise": layerwise,
                    "speedup_vs_serial": serial / row["measured"],
                    "speedup_vs_layerwise": layerwise / row["measured"]})
        if (case, metric) in one:
            row["efficiency"] = one[(case, metric)] / (p * row["measured"])
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    nan = float("nan")
    print("real MPI ranks against the model (seconds; error = predicted / measured - 1)")
    print(f"{'case':>5} {'metric':>8} {'P':>3} {'measured':>9} {'own traces':>10} {'error':>7} "
          f"{'virtual':>9} {'error':>7} {'serial':>9} {'layer-wise':>10} {'vs serial':>9} "
          f"{'vs lw':>6} {'eff':>5}")
    for r in sorted(rows, key=lambda r: (r["case"], r["metric"], r["ranks"])):
        print(f"{r['case']:>5} {r['metric']:>8} {r['ranks']:>3} {r['measured']:9.4f} "
              f"{r['predicted_from_mpi_traces']:10.4f} {r['error']:+7.1%} "
              f"{r.get('predicted_virtual', nan):9.4f} {r.get('virtual_error', nan):+7.1%} "
              f"{r['serial']:9.4f} "
              f"{r['layerwise']:10.4f} {r['speedup_vs_serial']:9.2f} "
              f"{r['speedup_vs_layerwise']:6.2f} {r.get('efficiency', nan):5.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)))
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one launch may take")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="virtual-rank runs at a time")
    parser.add_argument("--processes", type=int,
                        help="virtual-rank runs per point (default: each case's own)")
    parser.add_argument("--predict", type=Path, metavar="RANKS_JSON",
                        help="predict the measurements of an earlier run on this machine")
    parser.add_argument("--replay", type=Path, metavar="RANKS_JSON",
                        help="only replay the traces of an earlier run's measurements (on any "
                             "machine: the virtual-rank model needs the measuring machine)")
    args = parser.parse_args(argv)
    cases = tuple(args.cases.split(","))
    unknown = [c for c in cases if c not in CHECKS]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {sorted(CHECKS)}")
    if args.worker:
        worker(cases, args.repeats)
        return 0
    if args.out is None:
        parser.error("OUT_DIR is required")
    try:
        ranks = sorted({int(p) for p in args.ranks.split(",")})
    except ValueError:
        parser.error(f"--ranks takes rank counts separated by commas, got {args.ranks!r}")
    if ranks[0] < 1:
        parser.error("--ranks: every rank count must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    earlier = args.predict or args.replay
    if earlier is not None:
        records = {int(p): r for p, r in json.loads(earlier.read_text())["records"].items()}
    else:
        # the measurements first, on their own and after every rank count: the predictions
        # below take a while longer
        def save(records: dict[int, dict[str, Any]]) -> None:
            (args.out / "ranks.json").write_text(json.dumps({"records": records}))

        with torch_kernels():
            records = measure(ranks, cases, args.repeats, args.timeout, save)
    pings = {p: r["mgrit"]["ping_pong"] for p, r in records.items() if "ping_pong" in r["mgrit"]}
    if not pings:
        parser.error("the network is measured between two ranks: --ranks needs a count >= 2")
    ping = pings.get(2, next(iter(pings.values())))
    network = network_from(ping)
    rows = table(records, network, args.workers, args.processes, virtual=args.replay is None)
    result = {"rows": rows, "ping_pong": ping, "network": vars(network), "cases": {
        c: CHECKS[c].work().description for c in cases}, "repeats": args.repeats,
        "torch": torch.__version__, "cpus": os.cpu_count(), "records": records,
        "replayed_from": None if earlier is None else str(earlier)}
    (args.out / "ranks.json").write_text(json.dumps(result, indent=1))
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
