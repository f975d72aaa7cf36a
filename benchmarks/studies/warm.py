"""Virtual ranks with warm caches: each rank's compute timed again in a run of that rank
alone (docs/scaling.md, "Warm ranks").

In a virtual run (`virtual.work_traces`) the P ranks take turns on one core, so a rank
finds its caches holding the other ranks' data, where a real rank on a core of its own
finds its own: its compute spans are measured cold. Here the virtual run also records what
every rank received (messages and collective results, in order). Then each rank runs again
alone in this process, from the same start, with a communicator that hands it what it
received then (`ReplayComm`): the same program, the same events in the same order (checked,
event by event), its steps following each other on a core whose caches hold only its own
data, as a real rank's do. Its compute spans, timed on that run, replace the virtual
run's; both sets of traces are replayed on the same network.

    python -m benchmarks.studies.warm [--ranks 1,2,16,64] [--processes 3] [--launches 3]
                                      [--json PATH]

It checks both against W2's training step measured on 1 and 2 MPI ranks first (the
study's validation runs, W2 alone, with the kernels the environment selects:
`MGRIT_NATIVE=torch` for torch's, as the study's method comparison has them), and sets both
beside serial PyTorch and layer-wise model parallelism, modelled as in the study.

Question: how much of the virtual ranks' predicted step is cold caches?
Answer: warm ranks take a fifth to a third off from 16 ranks up; even warm, 64 ranks gain
1.65x over one on the native kernels. Results: docs/results/warm-native.json and
warm-torch.json; docs/scaling.md, "Warm ranks".
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
from collections import deque
from typing import Any

from torch import Tensor

from mgrit.app.replay import Event, Interconnect, replay
from mgrit.comm.virtual import run_ranks

from ..scaling import virtual
from ..scaling.cases import CURVES, SERIAL_DEPTHS, setup
from ..scaling.serial import fastest_serial, layerwise_traces, serial_costs, serial_seconds
from ..scaling.study import CLUSTER_BANDWIDTH, CLUSTER_LATENCY
from ..scaling.validation import launch_validation, network_from
from ..workloads import TrainingWorkload

OVERHEAD = 0.48e-6     # posting a persistent message here (the study's ping-pong)


class Received:
    """What one communicator of one rank received: each (source, tag)'s messages in the
    order their receives were posted (MPI's matching order), the results of its
    collectives in order, and the same for the communicators duplicated from it."""

    def __init__(self) -> None:
        self.messages: dict[tuple[int, int], list[Tensor | None]] = {}
        self.collectives: list[Any] = []
        self.dups: list[Received] = []


class _RecordedRecv:
    """A receive whose message is kept, once it has arrived, in its posted slot."""

    __slots__ = ("req", "buf", "slots", "k")

    def __init__(self, req: Any, buf: Tensor, slots: list[Tensor | None], k: int) -> None:
        self.req, self.buf, self.slots, self.k = req, buf, slots, k

    def wait(self) -> None:
        self.req.wait()
        if self.slots[self.k] is None:
            self.slots[self.k] = self.buf.detach().clone()


class RecordingComm:
    """A communicator that behaves like `inner` and keeps what it receives (`Received`)."""

    def __init__(self, inner: Any, received: Received) -> None:
        self.inner, self.received = inner, received
        self.rank, self.size = inner.rank, inner.size

    def isend(self, buf: Tensor, dest: int, tag: int) -> Any:
        return self.inner.isend(buf, dest, tag)

    def irecv(self, buf: Tensor, source: int, tag: int) -> Any:
        slots = self.received.messages.setdefault((source, tag), [])
        slots.append(None)
        return _RecordedRecv(self.inner.irecv(buf, source, tag), buf, slots, len(slots) - 1)

    def _keep(self, value: Any) -> Any:
        self.received.collectives.append(value.detach().clone() if isinstance(value, Tensor)
                                         else value)
        return value

    def allreduce_sum(self, value: float) -> float:
        return self._keep(self.inner.allreduce_sum(value))

    def allreduce_sum_(self, buf: Tensor) -> None:
        self.inner.allreduce_sum_(buf)
        self._keep(buf)

    def bcast_(self, buf: Tensor, root: int) -> None:
        self.inner.bcast_(buf, root)
        self._keep(buf)

    def agree(self, what: str, value: Any) -> None:
        self.inner.agree(what, value)
        self._keep(None)

    def gather_object(self, obj: Any, root: int) -> list[Any] | None:
        return self._keep(self.inner.gather_object(obj, root))

    def dup(self) -> "RecordingComm":
        child = Received()
        self.received.dups.append(child)
        return RecordingComm(self.inner.dup(), child)


class _Sent:
    def wait(self) -> None:
        pass


class _ReplayedRecv:
    __slots__ = ("buf", "value")

    def __init__(self, buf: Tensor, value: Tensor) -> None:
        self.buf, self.value = buf, value

    def wait(self) -> None:
        if self.value is not None:
            self.buf.copy_(self.value)
            self.value = None


class ReplayComm:
    """Rank `rank` of `size` on its own: sends go nowhere, receives and collectives give
    what the rank received in the recorded run (`Received`), in the same order."""

    def __init__(self, received: Received, rank: int, size: int) -> None:
        self.received, self.rank, self.size = received, rank, size
        self._messages = {key: deque(values) for key, values in received.messages.items()}
        self._collectives = deque(received.collectives)
        self._dups = deque(received.dups)

    def isend(self, buf: Tensor, dest: int, tag: int) -> Any:
        return _Sent()

    def irecv(self, buf: Tensor, source: int, tag: int) -> Any:
        value = self._messages[(source, tag)].popleft()
        if value is None:
            raise RuntimeError(f"rank {self.rank}: the recorded run never completed this "
                               f"receive from rank {source} (tag {tag})")
        return _ReplayedRecv(buf, value)

    def _next(self) -> Any:
        return self._collectives.popleft()

    def allreduce_sum(self, value: float) -> float:
        return self._next()

    def allreduce_sum_(self, buf: Tensor) -> None:
        buf.copy_(self._next())

    def bcast_(self, buf: Tensor, root: int) -> None:
        buf.copy_(self._next())

    def agree(self, what: str, value: Any) -> None:
        self._next()

    def gather_object(self, obj: Any, root: int) -> list[Any] | None:
        return self._next()

    def dup(self) -> "ReplayComm":
        return ReplayComm(self._dups.popleft(), self.rank, self.size)


def _same_events(a: list[Event], b: list[Event]) -> bool:
    """Whether two traces of a rank hold the same messages, collectives and marks in the
    same order (compute spans aside)."""
    return ([e for e in a if e[0] != "compute"] == [e for e in b if e[0] != "compute"])


def traces(case: str | TrainingWorkload, ranks: int, repeats: int = 3, warmup: int = 3
           ) -> tuple[list[list[list[Event]]], list[list[list[Event]]]]:
    """(cold, warm): traces [repeat][rank] of a virtual run of `case` (a scaling case's
    name, or a workload), and of each rank run again alone with what it received (in this
    process: `virtual.fresh` gives a clean one)."""
    work = CURVES[case].work() if isinstance(case, str) else case
    built = setup(work)
    received = [Received() for _ in range(ranks)]
    by_rank = run_ranks(ranks, lambda comm: virtual.rank_traces(
        work, built, RecordingComm(comm, received[comm.rank]), repeats, warmup))
    cold = [[by_rank[r][k] for r in range(ranks)] for k in range(repeats)]
    warm_by_rank = []
    collecting = gc.isenabled()
    gc.disable()        # as in the virtual run
    try:
        for r in range(ranks):
            gc.collect()
            # its own copy of the network, as in a process of its own
            alone = virtual.rank_traces(work, setup(work), ReplayComm(received[r], r, ranks),
                                        repeats, warmup)
            for k in range(repeats):
                if not _same_events(alone[k], cold[k][r]):
                    raise RuntimeError(f"rank {r} alone did not repeat its events of the "
                                       f"virtual run (step {k})")
            warm_by_rank.append(alone)
    finally:
        if collecting:
            gc.enable()
    warm = [[warm_by_rank[r][k] for r in range(ranks)] for k in range(repeats)]
    return cold, warm


def point(ranks: int, networks: dict[str, Interconnect], repeats: int = 3, warmup: int = 3
          ) -> dict[str, Any]:
    """W2's predicted step on `ranks` virtual ranks, cold and warm, per network (the
    fastest repeat of each), with each's mean busy time per rank and its critical path
    (a fresh process)."""
    cold, warm = virtual.fresh(traces, "w2", ranks, repeats, warmup)
    out: dict[str, Any] = {"ranks": ranks}
    for name, runs in (("cold", cold), ("warm", warm)):
        for label, network in networks.items():
            best = min((replay(t, network) for t in runs), key=lambda p: p.total)
            out.setdefault(name, {})[label] = {
                "seconds": best.total, "busy_mean": statistics.fmean(best.busy),
                "critical": best.critical}
    return out


def curve(counts: list[int], networks: dict[str, Interconnect], processes: int
          ) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """`point` for each rank count in `processes` fresh processes, run in rounds over the
    rank counts (the machine's slow phases last minutes); per count, kind and network the
    fastest. With it, serial PyTorch's per-layer costs (`serial_costs`, once a round, the
    fastest run), from which the baselines are modelled."""
    best: dict[int, dict[str, Any]] = {}
    serial_runs = []
    for _ in range(processes):
        serial_runs.append(virtual.fresh(serial_costs, CURVES["w2"], SERIAL_DEPTHS["w2"]))
        for p in counts:
            res = point(p, networks)
            kept = best.setdefault(p, {"ranks": p, "cold": {}, "warm": {}})
            for name in ("cold", "warm"):
                for label, pred in res[name].items():
                    held = kept[name].get(label)
                    if held is None or pred["seconds"] < held["seconds"]:
                        kept[name][label] = pred
    return best, fastest_serial(serial_runs, CURVES["w2"].num_steps)


def measured(launches: int = 3) -> dict[str, Any]:
    """W2's training step measured on 1 and 2 MPI ranks (the fastest repeat of `launches`
    launches per rank count, alternated) and the ping-pong of the 2-rank launches."""
    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for _ in range(launches):
        for p in runs:
            runs[p].append(launch_validation(p, ("w2",)))
    return {"ping_pong": runs[2][0]["ping_pong"],
            "train": {p: min(min(r["w2"]["train"]["measured"]) for r in records)
                      for p, records in runs.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.warm",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,16,64")
    parser.add_argument("--processes", type=int, default=3,
                        help="fresh processes per rank count, in rounds (the fastest counts)")
    parser.add_argument("--launches", type=int, default=3,
                        help="MPI launches per rank count (1 and 2) to check the model "
                        "against; 0: no check")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    counts = sorted({int(p) for p in args.ranks.split(",")}
                    | ({1, 2} if args.launches else set()))
    check = measured(args.launches) if args.launches else None
    overhead = check["ping_pong"]["overhead"] if check else OVERHEAD
    networks = {"cluster": Interconnect(CLUSTER_LATENCY, CLUSTER_BANDWIDTH, overhead)}
    if check:
        networks["shared memory"] = network_from(check["ping_pong"])
    best, serial = curve(counts, networks, args.processes)
    n = CURVES["w2"].num_steps
    serial_train = serial_seconds(serial, n, ("forward", "backward", "update"))
    layerwise = {p: replay(layerwise_traces(serial, n, p, train=True),
                           networks["cluster"]).total for p in counts}
    if 1 in best:
        # alone on one rank, the virtual run and the run again are the same situation
        # (every step follows the rank's own): repeats of one measurement
        for label in networks:
            runs = (best[1]["cold"][label], best[1]["warm"][label])
            best[1]["warm"][label] = min(runs, key=lambda pred: pred["seconds"])
    if check:
        print("Measured on 1 and 2 MPI ranks against virtual ranks, cold and warm (the "
              "network the ping-pong measured):")
        print("| ranks | measured | cold virtual | error | warm virtual | error |")
        print("|---|---|---|---|---|---|")
        for p in (1, 2):
            m = check["train"][p]
            c = best[p]["cold"]["shared memory"]["seconds"]
            w = best[p]["warm"]["shared memory"]["seconds"]
            print(f"| {p} | {m * 1e3:.2f} ms | {c * 1e3:.2f} ms | {c / m - 1:+.1%} | "
                  f"{w * 1e3:.2f} ms | {w / m - 1:+.1%} |")
        print()
    one = best[counts[0]]["warm"]["cluster"]["seconds"]
    print(f"W2 on virtual ranks, cluster network, {overhead * 1e6:.2f} us a message; fastest "
          f"of {args.processes} processes; serial PyTorch {serial_train * 1e3:.1f} ms, "
          "layer-wise model parallelism on the same network")
    print(f"| ranks | cold: step | busy per rank | vs layer-wise | warm: step | busy per rank "
          f"| vs layer-wise | warm: {counts[0]} rank(s) / P ranks |")
    print("|---|---|---|---|---|---|---|---|")
    for p in counts:
        c, w = best[p]["cold"]["cluster"], best[p]["warm"]["cluster"]
        print(f"| {p} | {c['seconds'] * 1e3:.2f} ms | {c['busy_mean'] * 1e3:.2f} ms | "
              f"{layerwise[p] / c['seconds']:.2f} | {w['seconds'] * 1e3:.2f} ms | "
              f"{w['busy_mean'] * 1e3:.2f} ms | {layerwise[p] / w['seconds']:.2f} | "
              f"{one / w['seconds']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"measured": check, "overhead": overhead,
                       "kernels_backend": os.environ.get("MGRIT_NATIVE", "auto"),
                       "serial_train": serial_train, "layerwise_train": layerwise,
                       "points": [best[p] for p in counts]}, f, indent=1)


if __name__ == "__main__":
    main()
