"""The scaling model against real MPI runs on 1 and 2 ranks: measured times and wall-clock
traces of W0's solve and of the CHECKS cases' training steps and no-grad forwards, a
ping-pong that measures the interconnect, and the comparison of the measured times with
replays of the runs' own traces and of virtual-rank traces.

    mpiexec -n P python -m mpi4py -m benchmarks.scaling.validation [CASE...]
                                    one validation run (of W0, W2 and W1 unless CASEs of
                                    CHECKS are named); rank 0 reports its record
"""

from __future__ import annotations

import copy
import logging
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import torch

from mgrit.app import launch
from mgrit.app.replay import Interconnect, replay
from mgrit.comm import Comm, recv_init, send_init
from mgrit.comm.mpi import MPIComm
from mgrit.comm.tracing import Tracer, TracingComm

from ..training import forward_fn
from ..workloads import w0_workload
from .cases import CHECKS, fastest, setup, shared_model, traced_step
from .virtual import fastest_points

log = logging.getLogger(__name__)

# validation runs launched per rank count, alternating 1 and 2 ranks: a 2-rank run needs both
# cores of the machine and is the first to suffer when something else takes one
VALIDATION_LAUNCHES = 3
# the cases of the study's validation (W0's solve and CHECKS' training)
VALIDATED = ("w0", "w2", "w1")


def ping_pong(comm: Comm, sizes: tuple[int, int] = (8, 1 << 20), rounds: int = 400
              ) -> dict[str, float]:
    """Interconnect parameters between ranks 0 and 1 from half round trips of a small and a
    large message: overhead (CPU time of posting a send), latency, bandwidth. The messages
    are persistent (`mgrit.comm.send_init`), as the solver's boundary values are; the
    posting time of a plain isend is reported too (`overhead_isend`)."""
    half, posting, plain = {}, [], []
    for n in sizes:
        buf = torch.zeros(n, dtype=torch.uint8)
        count = rounds if n < (1 << 16) else rounds // 8
        peer = 1 - comm.rank
        if comm.rank in (0, 1):
            sending, receiving = send_init(comm, buf, peer, 7), recv_init(comm, buf, peer, 7)
        for timed in (False, True):
            start = time.perf_counter()
            for _ in range(count):
                if comm.rank == 0:
                    t = time.perf_counter()
                    req = sending.start()
                    posting.append(time.perf_counter() - t)
                    req.wait()
                    receiving.start().wait()
                elif comm.rank == 1:
                    receiving.start().wait()
                    sending.start().wait()
            if timed:
                half[n] = (time.perf_counter() - start) / (2 * count)
    for _ in range(rounds if comm.rank in (0, 1) else 0):
        small = torch.zeros(sizes[0], dtype=torch.uint8)
        if comm.rank == 0:
            t = time.perf_counter()
            req = comm.isend(small, 1, 8)
            plain.append(time.perf_counter() - t)
            req.wait()
        else:
            comm.irecv(small, 0, 8).wait()
    small, large = sizes
    overhead = statistics.median(posting) if posting else 0.0
    return {"overhead": overhead, "latency": max(half[small] - overhead, 0.0),
            "bandwidth": (large - small) / max(half[large] - half[small], 1e-12),
            "half_round_trip_small": half[small], "half_round_trip_large": half[large],
            "overhead_isend": statistics.median(plain) if plain else 0.0}


def _measured_and_traced(world: Any, plain: Callable[[], Any], traced: Callable[[], Any],
                         tracer: Tracer, repeats: int) -> dict[str, Any]:
    """Alternately a timed plain run (from a barrier to the last rank's end) and a traced
    run, `repeats` times after a first round that warms both up."""
    from mpi4py import MPI

    times, traces = [], []
    for k in range(repeats + 1):
        world.Barrier()
        start = time.perf_counter()
        plain()
        elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
        world.Barrier()
        tracer.start()
        traced()
        trace = tracer.stop()
        if k:
            times.append(elapsed)
            traces.append(trace)
    gathered = world.gather(traces, root=0)
    return {"measured": times,
            "traces": None if gathered is None else
            [[gathered[r][k] for r in range(world.size)] for k in range(repeats)]}


def validation_record(cases: tuple[str, ...] = VALIDATED, repeats: int = 5
                      ) -> dict[str, Any] | None:
    """Under mpiexec: measured times and wall-clock traces of W0's solve and of training
    steps and no-grad forwards of CHECKS; a ping-pong between ranks 0 and 1 on 2 or more
    ranks. The whole record on rank 0, None elsewhere."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    tracer = Tracer()
    traced_comm = TracingComm(MPIComm(world), tracer)
    record: dict[str, Any] = {"ranks": world.size}
    if world.size >= 2:
        record["ping_pong"] = ping_pong(MPIComm(world))
    for name in cases:
        if name == "w0":
            w0 = w0_workload()
            record[name] = {"solve": _measured_and_traced(
                world, lambda: w0.solve(comm=world), lambda: w0.solve(comm=traced_comm),
                tracer, repeats)}
            continue
        work = CHECKS[name].work()
        net, layers, x, y = setup(work)
        plain = shared_model(work, net, layers, world)
        traced = shared_model(work, net, layers, traced_comm)
        record[name] = {
            "train": _measured_and_traced(world, traced_step(plain, work, x, y),
                                          traced_step(traced, work, x, y), tracer, repeats),
            "forward": _measured_and_traced(world, forward_fn(plain, x), forward_fn(traced, x),
                                            tracer, repeats)}
    return record if world.rank == 0 else None


def launch_validation(ranks: int, cases: tuple[str, ...] = VALIDATED) -> dict[str, Any]:
    """The record of one validation run of `cases` under `mpiexec -n ranks`."""
    done = launch.run(ranks, ["-m", "benchmarks.scaling.validation", *cases], timeout=1800)
    return done.check().reports[0]


def _measurements(record: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(case, metric, its measured times and traces) of a validation record."""
    for name, metrics in record.items():
        if isinstance(metrics, dict) and name != "ping_pong":
            for metric, data in metrics.items():
                yield name, metric, data


def merge_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Validation records of separate launches on the same rank count as one: the measured
    times and traces of every launch (the comparison takes the fastest of each), the first
    launch's ping-pong."""
    merged = copy.deepcopy(records[0])
    for record in records[1:]:
        for name, metric, data in _measurements(record):
            merged[name][metric]["measured"] += data["measured"]
            merged[name][metric]["traces"] += data["traces"]
    return merged


def network_from(ping: dict[str, float]) -> Interconnect:
    return Interconnect(latency=ping["latency"], bandwidth=ping["bandwidth"],
                        overhead=ping["overhead"])


def compare(record: dict[str, Any], network: Interconnect) -> list[dict[str, Any]]:
    """Measured (fastest repeat) against predicted from the record's own traces (fastest
    replay), for every case and metric of a validation record."""
    rows = []
    for name, metric, data in _measurements(record):
        measured = fastest(data["measured"])
        predicted = fastest(replay(t, network).total for t in data["traces"])
        rows.append({"case": name, "metric": metric, "ranks": record["ranks"],
                     "measured": measured, "predicted_from_mpi_traces": predicted,
                     "error": predicted / measured - 1.0})
    return rows


def virtual_checks(records: dict[int, dict[str, Any]], network: Interconnect,
                   processes: int | None = None) -> list[dict[str, Any]]:
    """The virtual-rank model against the measured times of the validation records (each
    point the fastest of its case's virtual runs, or of `processes` runs)."""
    rows = []
    jobs = [(ranks, name) for ranks, record in records.items()
            for name in ("w0", *CHECKS) if name in record]
    points = fastest_points([(CHECKS.get(name), ranks) for ranks, name in jobs],
                            {"": network}, processes=processes)
    for (ranks, name), point in zip(jobs, points):
        pred = point["predictions"][""]
        pairs = ([("solve", pred["seconds"])] if name == "w0" else
                 [("train", pred["seconds"]), ("forward", pred["forward_seconds"])])
        for metric, predicted in pairs:
            measured = fastest(records[ranks][name][metric]["measured"])
            rows.append({"case": name, "metric": metric, "ranks": ranks,
                         "predicted_virtual": predicted,
                         "virtual_error": predicted / measured - 1.0})
    return rows


def validation(cases: tuple[str, ...] = VALIDATED
               ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The ping-pong of 2 MPI ranks, and per case, metric and rank count (1, 2) the measured
    time (fastest of VALIDATION_LAUNCHES launches' repeats) against the replays of the MPI
    runs' own traces and of virtual-rank traces, on the network the ping-pong measured."""
    log.info("validation: measured and traced runs on 1 and 2 MPI ranks")
    launches: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for _ in range(VALIDATION_LAUNCHES):
        for p in launches:
            launches[p].append(launch_validation(p, cases))
    records = {p: merge_records(runs) for p, runs in launches.items()}
    network = network_from(records[2]["ping_pong"])
    rows = compare(records[1], network) + compare(records[2], network)
    virtual = {(r["case"], r["metric"], r["ranks"]): r for r in virtual_checks(records, network)}
    for row in rows:
        row.update(virtual[(row["case"], row["metric"], row["ranks"])])
    return records[2]["ping_pong"], rows


if __name__ == "__main__":
    record = validation_record(tuple(sys.argv[1:]) or VALIDATED)
    if record is not None:
        launch.report(record)
