"""Virtual ranks: P ranks as threads of one process, one running at a time, joined by
mailboxes that match messages in MPI's order. The real code runs on them unchanged, so a
study of hundreds of ranks needs no cluster; each rank's compute can be timed on its own
thread's CPU clock."""

from __future__ import annotations

import gc
import os
import threading
from typing import Any, Callable, TypeVar

import torch
from torch import Tensor

from .base import Request

T = TypeVar("T")

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
    Before, only the young generations are collected (what a previous run left): a full
    collection scans every object of the process, 60 ms a call in a test session.
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
    gc.collect(1)
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
        err.add_note(f"mgrit.comm.virtual: raised on virtual rank {rank} of {size}")
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
