"""Per-rank traces of compute and communication.

`TracingComm` wraps any mgrit communicator and records, for its rank, the compute time
between communication calls, every message (peer, bytes, channel, sequence number) and
every collective. `mgrit.app.replay` runs the traces of all ranks as if each rank had a
core of its own on a modelled interconnect; docs/scaling.md describes how this is used.

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

import time
from typing import Any, Callable

from torch import Tensor

from .base import Comm, Persistent, Request, recv_init, send_init

Event = list
Clock = Callable[[], float]


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


class _TracedPersistent:
    """A persistent message of a `TracingComm`: every start is recorded as an isend or an
    irecv would be."""

    __slots__ = ("comm", "inner", "peer", "channel", "nbytes", "send")

    def __init__(self, comm: "TracingComm", inner: Persistent, peer: int, channel: str,
                 nbytes: int, send: bool) -> None:
        self.comm, self.inner, self.peer = comm, inner, peer
        self.channel, self.nbytes, self.send = channel, nbytes, send

    def start(self) -> Request:
        if self.send:
            return self.comm._send(self.peer, self.nbytes, self.channel, self.inner.start)
        return self.comm._receive(self.peer, self.channel, self.inner.start)


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

    def _send(self, dest: int, nbytes: int, channel: str, post: Callable[[], Request]
              ) -> Request:
        """Record the next send to dest on channel and post it (`post`)."""
        self.tracer.enter()
        seq = self._next(self._sent, dest, channel)
        self.tracer.record(["send", dest, nbytes, channel, seq])
        req = post()
        self.tracer.leave()
        return _TracedSend(req, self.tracer)

    def _receive(self, source: int, channel: str, post: Callable[[], Request]) -> Request:
        """Post the next receive from source on channel (`post`); its first wait is
        recorded."""
        self.tracer.enter()
        seq = self._next(self._posted, source, channel)
        req = post()
        self.tracer.leave()
        return _TracedRecv(req, self.tracer, ["wait", source, channel, seq])

    def isend(self, buf: Tensor, dest: int, tag: int) -> Request:
        return self._send(dest, _nbytes(buf), f"{self.name}:{tag}",
                          lambda: self.inner.isend(buf, dest, tag))

    def irecv(self, buf: Tensor, source: int, tag: int) -> Request:
        return self._receive(source, f"{self.name}:{tag}",
                             lambda: self.inner.irecv(buf, source, tag))

    def send_init(self, buf: Tensor, dest: int, tag: int) -> Persistent:
        return _TracedPersistent(self, send_init(self.inner, buf, dest, tag), dest,
                                 f"{self.name}:{tag}", _nbytes(buf), True)

    def recv_init(self, buf: Tensor, source: int, tag: int) -> Persistent:
        return _TracedPersistent(self, recv_init(self.inner, buf, source, tag), source,
                                 f"{self.name}:{tag}", _nbytes(buf), False)

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
