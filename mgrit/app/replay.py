"""Trace files and their replay: every rank's recorded compute and messages (see
`mgrit.comm.tracing`) run as if each rank had a core of its own on a modelled interconnect;
the time the last rank finishes is the predicted run time."""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Event = list

@dataclass(frozen=True)
class Interconnect:
    """The modelled interconnect: a message of n bytes sent at time t costs its sender
    `overhead` and arrives at t + overhead + latency + n / bandwidth. A collective over
    P ranks costs ceil(log2 P) such hops after its last participant arrives (a broadcast:
    after its root arrives)."""

    latency: float
    bandwidth: float
    overhead: float = 0.0

    def __post_init__(self) -> None:
        if not (self.latency >= 0 and self.bandwidth > 0 and self.overhead >= 0):
            raise ValueError(f"need latency >= 0, bandwidth > 0, overhead >= 0; got {self}")

    def hop(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass
class Prediction:
    """What a replay gives.

    total:     time the last rank finishes (the critical path length)
    finish:    each rank's finish time
    busy:      each rank's compute plus send overheads
    marks:     for each mark label, the latest time a rank reached it
    critical:  the critical path split into compute and communication seconds and its
               number of message hops
    path:      with `replay(..., keep_path=True)`, the compute events on the critical path
               in order, as (rank, event index); None otherwise
    path_hops: with `keep_path`, the message hops on the critical path before each of those
               events (so the hops between two of them are the difference); None otherwise
    """

    total: float
    finish: list[float]
    busy: list[float]
    marks: dict[str, float]
    critical: dict[str, float] = field(default_factory=dict)
    path: list[tuple[int, int]] | None = None
    path_hops: list[int] | None = None

    @property
    def idle(self) -> list[float]:
        return [self.total - b for b in self.busy]


class ReplayError(RuntimeError):
    """The traces cannot all complete: a wait without its send, or a cycle of waits."""


# a path is (compute seconds, communication seconds, hops) along the chain of events
# that determined a rank's clock; with keep_path, a fourth entry is the chain's last compute
# event as a node (previous node, rank, event index, hops before it), shared by the chains
# that branch from it
_Path = tuple


def replay(traces: list[list[Event]], network: Interconnect, compute_scale: float = 1.0,
           keep_path: bool = False) -> Prediction:
    """Discrete-event replay of every rank's trace, each rank on a core of its own.

    Compute spans advance the rank's clock (times `compute_scale`), a send costs the
    sender `network.overhead`, a wait sets the clock to max(clock, arrival), a collective
    ends for all its participants ceil(log2 P) hops after the last arrives (a broadcast:
    after its root arrives; the root goes on at once). Raises `ReplayError` when the
    traces cannot all complete. `keep_path` also gives the critical path's compute events
    (`Prediction.path`), at the price of one small tuple per compute event.
    """
    size = len(traces)
    clock = [0.0] * size
    busy = [0.0] * size
    path: list[_Path] = [(0.0, 0.0, 0, None) if keep_path else (0.0, 0.0, 0)] * size
    pos = [0] * size
    marks: dict[str, float] = {}
    arrivals: dict[tuple, tuple[float, _Path]] = {}
    blocked: dict[tuple, int] = {}
    gatherings: dict[tuple[str, int], dict[int, tuple[float, _Path]]] = {}
    ready = deque(range(size))

    def arrive(r: int, event: Event) -> bool:
        """Rank r reaches a collective; True when it may go on at once."""
        _, op, channel, seq, nbytes, group, root = event
        key = (channel, seq)
        arrived = gatherings.setdefault(key, {})
        arrived[r] = (clock[r], path[r])
        if op == "bcast":
            if root not in arrived:
                return False
            done = list(arrived) if r == root else [r]
            t, via = arrived[root]
        else:
            if len(arrived) < group:
                return False
            done = list(arrived)
            t, via = max(arrived.values(), key=lambda a: a[0])
        hops = math.ceil(math.log2(group)) if group > 1 else 0
        end = t + hops * network.hop(nbytes)
        for q in done:
            if not (op == "bcast" and q == root) and end >= clock[q]:
                clock[q] = end
                path[q] = (via[0], via[1] + end - t, via[2] + hops, *via[3:])
            if q != r:
                pos[q] += 1
                ready.append(q)
        if len(arrived) == group:
            del gatherings[key]
        return True

    while ready:
        r = ready.popleft()
        events = traces[r]
        while pos[r] < len(events):
            event = events[pos[r]]
            kind = event[0]
            if kind == "compute":
                span = event[1] * compute_scale
                clock[r] += span
                busy[r] += span
                if keep_path:
                    compute, communication, hops, node = path[r]
                    path[r] = (compute + span, communication, hops, (node, r, pos[r], hops))
                else:
                    path[r] = (path[r][0] + span, path[r][1], path[r][2])
            elif kind == "send":
                _, dest, nbytes, channel, seq = event
                key = (r, dest, channel, seq)
                if key in arrivals:
                    raise ReplayError(f"rank {r} sends message {key} twice")
                clock[r] += network.overhead
                busy[r] += network.overhead
                flight = network.hop(nbytes)
                if keep_path:
                    compute, communication, hops, node = path[r]
                    path[r] = (compute, communication + network.overhead, hops, node)
                    arrivals[key] = (clock[r] + flight,
                                     (compute, path[r][1] + flight, hops + 1, node))
                else:
                    compute, communication, hops = path[r]
                    path[r] = (compute, communication + network.overhead, hops)
                    arrivals[key] = (clock[r] + flight,
                                     (compute, path[r][1] + flight, hops + 1))
                if key in blocked:
                    ready.append(blocked.pop(key))
            elif kind == "wait":
                _, source, channel, seq = event
                key = (source, r, channel, seq)
                if key not in arrivals:
                    blocked[key] = r
                    break
                arrival, via = arrivals.pop(key)
                if arrival > clock[r]:
                    clock[r], path[r] = arrival, via
            elif kind == "collective":
                if not arrive(r, event):
                    break
            elif kind == "mark":
                marks[event[1]] = max(marks.get(event[1], 0.0), clock[r])
            else:
                raise ReplayError(f"rank {r}: unknown event {event!r}")
            pos[r] += 1
    stuck = [r for r in range(size) if pos[r] < len(traces[r])]
    if stuck:
        shown = "; ".join(f"rank {r} at {traces[r][pos[r]]!r}" for r in stuck[:4])
        raise ReplayError(f"{len(stuck)} ranks cannot go on ({shown}): a wait whose message "
                          "is never sent, or ranks waiting for each other")
    if not size:
        return Prediction(0.0, [], [], {}, {}, [] if keep_path else None,
                          [] if keep_path else None)
    total = max(clock)
    compute, communication, hops, *node = path[clock.index(total)]
    spans = counts = None
    if keep_path:
        spans, counts, last = [], [], node[0]
        while last is not None:
            last, r, index, before = last
            spans.append((r, index))
            counts.append(before)
        spans.reverse()
        counts.reverse()
    return Prediction(total=total, finish=clock, busy=busy, marks=marks,
                      critical={"compute": compute, "communication": communication,
                                "hops": hops}, path=spans, path_hops=counts)


def step_spans(pred: Prediction, prefix: str = "step") -> list[float]:
    """Predicted time of each step of a trace whose ranks mark the end of step k with
    `{prefix}{k}` (k = 1, 2, ...): the time between consecutive marks, the first from the
    start of the trace."""
    ends: list[float] = []
    while f"{prefix}{len(ends) + 1}" in pred.marks:
        ends.append(pred.marks[f"{prefix}{len(ends) + 1}"])
    return [end - begin for begin, end in zip([0.0, *ends], ends)]


# Files ------------------------------------------------------------------------------------

def save_traces(path: str | Path, traces: list[list[Event]], **meta: Any) -> None:
    """Write the traces of all ranks (and any JSON-ready `meta`) to one JSON file."""
    Path(path).write_text(json.dumps({"format": 1, "meta": meta, "ranks": traces}))


def load_traces(path: str | Path) -> tuple[list[list[Event]], dict[str, Any]]:
    """(traces, meta) from a file that `save_traces` wrote."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != 1:
        raise ValueError(f"{path} is not a trace file of format 1")
    return data["ranks"], data["meta"]
