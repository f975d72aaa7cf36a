"""Per-rank traces of compute and communication, and their replay on a modelled machine.

`TracingComm` wraps any mgrit communicator and records, for its rank, the compute time
between communication calls, every message (peer, bytes, channel, sequence number) and
every collective. `replay` runs the traces of all ranks as if each rank had a core of its
own and the ranks were joined by a network of given latency, bandwidth and per-message
overhead; the time the last rank finishes is the length of the critical path, the
predicted run time. DESIGN.md section 7 and docs/scaling.md describe how this is used.

A trace is a list of events, each a JSON-ready list:

    ["compute", seconds]
    ["send", dest, bytes, channel, seq]        the seq-th message to dest on channel
    ["wait", source, channel, seq]             the rank needs that message from source now
    ["collective", kind, channel, seq, bytes, size, root]
    ["mark", label]                            a named point (end of a phase)

Messages match by (source, dest, channel, seq), which is MPI's non-overtaking order:
the k-th receive a rank posts from a source on a tag gets the k-th message sent to it.
"""

from __future__ import annotations

import gc
import json
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from torch import Tensor

from .comm import Comm, Request

Event = list
Clock = Callable[[], float]
T = TypeVar("T")


class Tracer:
    """One rank's recorder. Compute is the clock's advance outside communication calls;
    `clock` is the wall clock for real processes, a thread's CPU clock for virtual ranks."""

    def __init__(self, clock: Clock = time.perf_counter) -> None:
        self.clock = clock
        self.events: list[Event] = []
        self.recording = False
        self._resume = 0.0

    def start(self) -> None:
        """Begin a new trace: from now on, time and messages are recorded."""
        self.events = []
        self.recording = True
        self._resume = self.clock()

    def stop(self) -> list[Event]:
        """End the trace and return its events."""
        self.enter()
        self.recording = False
        return self.events

    def _compute(self, seconds: float) -> None:
        if seconds <= 0.0:
            return
        if self.events and self.events[-1][0] == "compute":
            self.events[-1][1] += seconds
        else:
            self.events.append(["compute", seconds])

    def enter(self) -> None:
        """A communication call begins: close the compute span that led to it."""
        if self.recording:
            self._compute(self.clock() - self._resume)

    def leave(self) -> None:
        """A communication call ends: compute resumes."""
        self._resume = self.clock()

    def charge(self, seconds: float) -> None:
        """Count `seconds` of modelled compute in place of the time since `enter()`."""
        if self.recording:
            self._compute(seconds)
        self.leave()

    def record(self, event: Event) -> None:
        if self.recording:
            self.events.append(event)

    def mark(self, label: str) -> None:
        self.enter()
        self.record(["mark", label])
        self.leave()


class _TracedRecv:
    """A receive request whose first wait is recorded where the rank needs the message."""

    __slots__ = ("req", "tracer", "event")

    def __init__(self, req: Request, tracer: Tracer, event: Event) -> None:
        self.req, self.tracer, self.event = req, tracer, event

    def wait(self) -> None:
        self.tracer.enter()
        if self.event is not None:
            self.tracer.record(self.event)
            self.event = None
        self.req.wait()
        self.tracer.leave()


class _TracedSend:
    """A send request: time spent completing it is not compute (the model never blocks
    a sender)."""

    __slots__ = ("req", "tracer")

    def __init__(self, req: Request, tracer: Tracer) -> None:
        self.req, self.tracer = req, tracer

    def wait(self) -> None:
        self.tracer.enter()
        self.req.wait()
        self.tracer.leave()


def _nbytes(buf: Tensor) -> int:
    return buf.numel() * buf.element_size()


class TracingComm:
    """A communicator that records what `inner` does for `tracer` and otherwise behaves
    exactly like it. `name` names its channels; `dup()` gives a tracing communicator on
    `inner.dup()` sharing the tracer, named after the order of dups (the same on every
    rank, as communicator creation is collective)."""

    def __init__(self, inner: Comm, tracer: Tracer, name: str = "world") -> None:
        self.inner = inner
        self.tracer = tracer
        self.name = name
        self.rank = inner.rank
        self.size = inner.size
        self._sent: dict[tuple[int, str], int] = {}
        self._posted: dict[tuple[int, str], int] = {}
        self._collectives = 0
        self._dups = 0

    def _next(self, counter: dict[tuple[int, str], int], peer: int, channel: str) -> int:
        seq = counter.get((peer, channel), 0)
        counter[(peer, channel)] = seq + 1
        return seq

    def isend(self, buf: Tensor, dest: int, tag: int) -> Request:
        channel = f"{self.name}:{tag}"
        self.tracer.enter()
        seq = self._next(self._sent, dest, channel)
        self.tracer.record(["send", dest, _nbytes(buf), channel, seq])
        req = self.inner.isend(buf, dest, tag)
        self.tracer.leave()
        return _TracedSend(req, self.tracer)

    def irecv(self, buf: Tensor, source: int, tag: int) -> Request:
        channel = f"{self.name}:{tag}"
        self.tracer.enter()
        seq = self._next(self._posted, source, channel)
        req = self.inner.irecv(buf, source, tag)
        self.tracer.leave()
        return _TracedRecv(req, self.tracer, ["wait", source, channel, seq])

    def _collective(self, kind: str, nbytes: int, root: int, call: Callable[[], Any]) -> Any:
        self.tracer.enter()
        seq = self._collectives
        self._collectives += 1
        self.tracer.record(["collective", kind, self.name, seq, nbytes, self.size, root])
        try:
            return call()
        finally:
            self.tracer.leave()

    def allreduce_sum(self, value: float) -> float:
        return self._collective("allreduce", 8, -1, lambda: self.inner.allreduce_sum(value))

    def allreduce_sum_(self, buf: Tensor) -> None:
        self._collective("allreduce", _nbytes(buf), -1, lambda: self.inner.allreduce_sum_(buf))

    def bcast_(self, buf: Tensor, root: int) -> None:
        self._collective("bcast", _nbytes(buf), root, lambda: self.inner.bcast_(buf, root))

    def agree(self, what: str, value: Any) -> None:
        self._collective("allgather", len(repr(value)), -1, lambda: self.inner.agree(what, value))

    def gather_object(self, obj: Any, root: int) -> list[Any] | None:
        return self._collective("gather", len(repr(obj)), root,
                                lambda: self.inner.gather_object(obj, root))

    def dup(self) -> "TracingComm":
        self._dups += 1
        return TracingComm(self.inner.dup(), self.tracer, f"{self.name}.{self._dups}")


# Virtual ranks ---------------------------------------------------------------------------

class VirtualFailure(RuntimeError):
    """Another virtual rank failed, or this one waited past the world's timeout."""


class _Gathering:
    """One collective call in progress: the ranks' contributions and, once all are in,
    the result (or the error) that every rank gets."""

    __slots__ = ("values", "done", "result", "error", "readers")

    def __init__(self) -> None:
        self.values: dict[int, Any] = {}
        self.done = threading.Event()
        self.result: Any = None
        self.error: Exception | None = None
        self.readers = 0


class VirtualWorld:
    """Mailboxes and collectives shared by the threads that play the ranks.

    One rank runs at a time: a rank holds the `turn` while it computes and hands it on
    only when it has to wait, so each compute span runs uninterrupted on one core.
    """

    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.timeout = timeout
        self.turn = threading.Lock()
        self._lock = threading.Lock()
        self._arrived = [threading.Condition(self._lock) for _ in range(size)]
        self._messages: dict[tuple, Tensor] = {}
        self._gatherings: dict[tuple[str, int], _Gathering] = {}
        self.failure: tuple[int, BaseException] | None = None

    def fail(self, rank: int, error: BaseException) -> None:
        """Keep the first failure and wake every waiting rank so that it gives up."""
        with self._lock:
            if self.failure is None:
                self.failure = (rank, error)
            for cond in self._arrived:
                cond.notify_all()
            gatherings = list(self._gatherings.values())
        for g in gatherings:
            g.done.set()

    def _check(self, rank: int, waited: float) -> None:
        if self.failure is not None:
            raise VirtualFailure(f"virtual rank {rank} stops: rank {self.failure[0]} failed")
        if waited > self.timeout:
            raise VirtualFailure(f"virtual rank {rank} waited over {self.timeout} s (deadlock?)")

    def post(self, key: tuple, dest: int, value: Tensor) -> None:
        with self._lock:
            self._messages[key] = value
            self._arrived[dest].notify_all()

    def take(self, key: tuple, rank: int) -> Tensor:
        """The message `key` for `rank`, once it is there."""
        waited = 0.0
        while True:
            with self._lock:
                if key in self._messages:
                    return self._messages.pop(key)
                self._check(rank, waited)
                self.turn.release()
                self._arrived[rank].wait(1.0)
            self.turn.acquire()
            waited += 1.0

    def gather(self, key: tuple[str, int], rank: int, size: int, value: Any,
               combine: Callable[[list[Any]], Any]) -> Any:
        """Contribute `value`; once all `size` ranks have, every one gets combine(values)."""
        with self._lock:
            g = self._gatherings.setdefault(key, _Gathering())
            g.values[rank] = value
            if len(g.values) == size:
                try:
                    g.result = combine([g.values[r] for r in range(size)])
                except Exception as err:  # every rank raises it, as MPI ranks would
                    g.error = err
                g.done.set()
        waited = 0.0
        self.turn.release()
        try:
            while not g.done.wait(1.0) and self.failure is None and waited <= self.timeout:
                waited += 1.0
        finally:
            self.turn.acquire()
        self._check(rank, waited)
        with self._lock:
            g.readers += 1
            if g.readers == size:
                del self._gatherings[key]
        if g.error is not None:
            raise g.error
        return g.result


class _Done:
    def wait(self) -> None:
        return None


class _VirtualRecv:
    __slots__ = ("world", "key", "rank", "buf", "done")

    def __init__(self, world: VirtualWorld, key: tuple, rank: int, buf: Tensor) -> None:
        self.world, self.key, self.rank, self.buf = world, key, rank, buf
        self.done = False

    def wait(self) -> None:
        if not self.done:
            self.buf.copy_(self.world.take(self.key, self.rank))
            self.done = True


class VirtualComm:
    """The `mgrit.comm.Comm` of one virtual rank. A message is a copy left in a mailbox
    keyed by (communicator, source, dest, tag, sequence number), so messages match in
    MPI's order; collectives combine the ranks' values in rank order."""

    def __init__(self, world: VirtualWorld, rank: int, name: str = "world") -> None:
        self.world = world
        self.rank = rank
        self.size = world.size
        self.name = name
        self._sent: dict[tuple[int, int], int] = {}
        self._posted: dict[tuple[int, int], int] = {}
        self._collectives = 0
        self._dups = 0

    def _next(self, counter: dict[tuple[int, int], int], peer: int, tag: int) -> int:
        seq = counter.get((peer, tag), 0)
        counter[(peer, tag)] = seq + 1
        return seq

    def isend(self, buf: Tensor, dest: int, tag: int) -> Request:
        seq = self._next(self._sent, dest, tag)
        self.world.post((self.name, self.rank, dest, tag, seq), dest, buf.detach().clone())
        return _Done()

    def irecv(self, buf: Tensor, source: int, tag: int) -> Request:
        seq = self._next(self._posted, source, tag)
        return _VirtualRecv(self.world, (self.name, source, self.rank, tag, seq), self.rank, buf)

    def _gather(self, value: Any, combine: Callable[[list[Any]], Any]) -> Any:
        key = (self.name, self._collectives)
        self._collectives += 1
        return self.world.gather(key, self.rank, self.size, value, combine)

    def allreduce_sum(self, value: float) -> float:
        return self._gather(float(value), sum)

    def allreduce_sum_(self, buf: Tensor) -> None:
        buf.copy_(self._gather(buf.detach().clone(), lambda values: sum(values[1:], values[0])))

    def bcast_(self, buf: Tensor, root: int) -> None:
        value = buf.detach().clone() if self.rank == root else None
        result = self._gather(value, lambda values: values[root])
        if self.rank != root:
            buf.copy_(result)

    def agree(self, what: str, value: Any) -> None:
        def check(values: list[Any]) -> None:
            differing = [r for r, v in enumerate(values) if v != values[0]]
            if differing:
                r = differing[0]
                raise ValueError(f"{what} differ between ranks (rank 0: {values[0]!r}; rank "
                                 f"{r}: {values[r]!r}); every rank must pass the same settings")
        self._gather(value, check)

    def gather_object(self, obj: Any, root: int) -> list[Any] | None:
        values = self._gather(obj, list)
        return values if self.rank == root else None

    def dup(self) -> "VirtualComm":
        self._dups += 1
        return VirtualComm(self.world, self.rank, f"{self.name}.{self._dups}")


def run_ranks(size: int, program: Callable[[VirtualComm], T], timeout: float = 600.0
              ) -> list[T]:
    """Run `program(comm)` for `size` virtual ranks, one thread each, one at a time; their
    results in rank order. An exception on any rank stops every rank and is raised here.

    Python's cyclic garbage collector is paused meanwhile: a collection scans every
    virtual rank's objects and would be charged to whichever rank happened to trigger it.
    The ranks' threads are bound to one core (where the platform allows it): a thread
    woken on another core than the one its predecessor ran on finds that core's caches
    cold and pays for it in its next steps, a cost that a real rank, which keeps a core
    of its own, never pays.
    """
    world = VirtualWorld(size, timeout)
    results: list[Any] = [None] * size

    def main(rank: int) -> None:
        world.turn.acquire()
        try:
            torch.set_num_threads(1)
            results[rank] = program(VirtualComm(world, rank))
        except BaseException as err:  # handed to the caller below
            world.fail(rank, err)
        finally:
            world.turn.release()

    threads = [threading.Thread(target=main, args=(r,), name=f"virtual-rank-{r}", daemon=True)
               for r in range(size)]
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    cores = _bind_to_one_core()
    try:
        for t in threads:       # a thread starts with its creator's core binding
            t.start()
        for t in threads:
            t.join()
    finally:
        if cores is not None:
            os.sched_setaffinity(0, cores)
        if collecting:
            gc.enable()
    if world.failure is not None:
        rank, err = world.failure
        err.add_note(f"mgrit.trace: raised on virtual rank {rank} of {size}")
        raise err
    return results


def _bind_to_one_core() -> set[int] | None:
    """Bind the calling thread to one of the cores it may run on; the previous set of
    cores, to restore, or None where the platform cannot bind threads."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(cores)})
    except OSError:         # a sandbox may forbid it: the ranks then run where they may
        return None
    return cores


# Replay ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Network:
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
    """

    total: float
    finish: list[float]
    busy: list[float]
    marks: dict[str, float]
    critical: dict[str, float] = field(default_factory=dict)

    @property
    def idle(self) -> list[float]:
        return [self.total - b for b in self.busy]


class ReplayError(RuntimeError):
    """The traces cannot all complete: a wait without its send, or a cycle of waits."""


# a path is (compute seconds, communication seconds, hops) along the chain of events
# that determined a rank's clock
_Path = tuple[float, float, int]


def replay(traces: list[list[Event]], network: Network, compute_scale: float = 1.0
           ) -> Prediction:
    """Discrete-event replay of every rank's trace, each rank on a core of its own.

    Compute spans advance the rank's clock (times `compute_scale`), a send costs the
    sender `network.overhead`, a wait sets the clock to max(clock, arrival), a collective
    ends for all its participants ceil(log2 P) hops after the last arrives (a broadcast:
    after its root arrives; the root goes on at once). Raises `ReplayError` when the
    traces cannot all complete.
    """
    size = len(traces)
    clock = [0.0] * size
    busy = [0.0] * size
    path: list[_Path] = [(0.0, 0.0, 0)] * size
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
                path[q] = (via[0], via[1] + end - t, via[2] + hops)
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
                path[r] = (path[r][0] + span, path[r][1], path[r][2])
            elif kind == "send":
                _, dest, nbytes, channel, seq = event
                key = (r, dest, channel, seq)
                if key in arrivals:
                    raise ReplayError(f"rank {r} sends message {key} twice")
                clock[r] += network.overhead
                busy[r] += network.overhead
                compute, communication, hops = path[r]
                path[r] = (compute, communication + network.overhead, hops)
                flight = network.hop(nbytes)
                arrivals[key] = (clock[r] + flight, (compute, path[r][1] + flight, hops + 1))
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
        return Prediction(0.0, [], [], {}, {})
    total = max(clock)
    compute, communication, hops = path[clock.index(total)]
    return Prediction(total=total, finish=clock, busy=busy, marks=marks,
                      critical={"compute": compute, "communication": communication,
                                "hops": hops})


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
