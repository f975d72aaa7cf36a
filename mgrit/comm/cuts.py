"""Messages between the graphs of a captured run on several ranks.

A CUDA graph holds device work only: the messages of a layer-parallel run on several ranks
(host MPI calls) cannot be inside one. A captured run is therefore cut at every message: a
graph of the work up to it, the message as a host step, a graph of the work after it, and so
on; a replay runs graphs and host steps in that order (`mgrit.execute.Segmented`).

`CutComm` wraps a model's communicator (and every duplicate of it) so that its calls can be
cut there. Outside a capture it hands every call to the communicator it wraps. While a run
is captured (`Cuts.session` is set) each call that moves tensors is handed to the session
as a host step (`Session.host`): the session ends the graph being captured, runs the call
(after the captured work, which its buffers hold), keeps it for the replays and begins the
next graph. A message posted in the captured run returns a `_Posted` whose wait is a host
step too, and which every replay's post sets again; the run must complete every message it
posts (a solve ends by draining its levels), which `Cuts.end` checks. Calls that exchange
host values only (`agree`, `gather_object`: checks of settings that every replay keeps) cut
the capture too, so that no MPI call runs while a stream is captured, but are not replayed;
`allreduce_sum`, whose float the run would use on the host, is refused.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, TypeVar

from torch import Tensor

from .base import Comm, Persistent, Request, recv_init, send_init

T = TypeVar("T")


class CutError(RuntimeError):
    """A call of a captured run that a replay could not repeat."""


class Session(Protocol):
    """What a capture does at a message (`mgrit.execute.graphs`, or a check that runs the
    calls as they come)."""

    def host(self, action: Callable[[], T], replay: bool = True) -> T:
        """End the graph being captured, run `action` once the work before it has run,
        keep it as a host step of every replay (unless `replay` is False) and begin the
        next graph."""
        ...


class Cuts:
    """Shared by a model's `CutComm`s: the session of the run being captured, if any, and
    the messages it posted (`_Posted`), each of which it must complete."""

    def __init__(self) -> None:
        self.session: Session | None = None
        self._posted: list[_Posted] = []

    def begin(self, session: Session) -> None:
        self.session, self._posted = session, []

    def end(self, complete: bool = True) -> None:
        """The run is over; with `complete`, check that it completed every message it
        posted (a replay would otherwise post messages that nothing completes)."""
        open_ = [p for p in self._posted if not p.done]
        self.session, self._posted = None, []
        if complete and open_:
            raise CutError(f"{len(open_)} message(s) posted in the captured run were not "
                           f"completed in it (first: {open_[0].what}); a replay would post "
                           "them again with nothing waiting for them")

    def post(self, what: str, start: Callable[[], Request]) -> Request:
        """A message posted while a run is captured: a `_Posted` that every replay posts
        again."""
        posted = _Posted(self, what, start)
        self._posted.append(posted)
        self.session.host(posted.start)
        return posted


class _Posted:
    """A message posted in a captured run: `start` posts it (at capture and in every
    replay) and keeps the communicator's request, which `wait` completes."""

    __slots__ = ("cuts", "what", "post", "req", "done")

    def __init__(self, cuts: Cuts, what: str, post: Callable[[], Request]) -> None:
        self.cuts, self.what, self.post = cuts, what, post
        self.req: Request | None = None
        self.done = False

    def start(self) -> None:
        self.req = self.post()

    def _complete(self) -> None:
        req, self.req = self.req, None      # nothing holds its buffers between replays
        req.wait()

    def wait(self) -> None:
        if self.done:           # a request is completed once; later waits return at once
            return
        self.done = True
        session = self.cuts.session
        if session is None:
            self._complete()
        else:
            session.host(self._complete)


class _CutPersistent:
    """A persistent message of a `CutComm` (the wrapped communicator's, `send_init` or
    `recv_init`)."""

    __slots__ = ("cuts", "inner", "what")

    def __init__(self, cuts: Cuts, inner: Persistent, what: str) -> None:
        self.cuts, self.inner, self.what = cuts, inner, what

    def start(self) -> Request:
        if self.cuts.session is None:
            return self.inner.start()
        return self.cuts.post(self.what, self.inner.start)


class CutComm:
    """A communicator that behaves as `inner` does and whose calls are cut out of a
    captured run while `cuts.session` is set (see the module's docstring). Its duplicates
    share `cuts`."""

    def __init__(self, inner: Comm, cuts: Cuts | None = None) -> None:
        self.inner = inner
        self.cuts = cuts if cuts is not None else Cuts()
        self.rank = inner.rank
        self.size = inner.size

    def isend(self, buf: Tensor, dest: int, tag: int) -> Request:
        if self.cuts.session is None:
            return self.inner.isend(buf, dest, tag)
        return self.cuts.post(f"a send to rank {dest}, tag {tag}",
                              lambda: self.inner.isend(buf, dest, tag))

    def irecv(self, buf: Tensor, source: int, tag: int) -> Request:
        if self.cuts.session is None:
            return self.inner.irecv(buf, source, tag)
        return self.cuts.post(f"a receive from rank {source}, tag {tag}",
                              lambda: self.inner.irecv(buf, source, tag))

    def send_init(self, buf: Tensor, dest: int, tag: int) -> Persistent:
        return _CutPersistent(self.cuts, send_init(self.inner, buf, dest, tag),
                              f"a send to rank {dest}, tag {tag}")

    def recv_init(self, buf: Tensor, source: int, tag: int) -> Persistent:
        return _CutPersistent(self.cuts, recv_init(self.inner, buf, source, tag),
                              f"a receive from rank {source}, tag {tag}")

    # the check comes first and the closure only inside a capture: these run every cycle
    def allreduce_sum_(self, buf: Tensor) -> None:
        session = self.cuts.session
        if session is None:
            self.inner.allreduce_sum_(buf)
        else:
            session.host(lambda: self.inner.allreduce_sum_(buf))

    def bcast_(self, buf: Tensor, root: int) -> None:
        session = self.cuts.session
        if session is None:
            self.inner.bcast_(buf, root)
        else:
            session.host(lambda: self.inner.bcast_(buf, root))

    def allreduce_sum(self, value: float) -> float:
        if self.cuts.session is not None:
            raise CutError("allreduce_sum returns a float to the host, which a replay "
                           "would keep as it was at capture: a captured run sums "
                           "tensors (allreduce_sum_)")
        return self.inner.allreduce_sum(value)

    def agree(self, what: str, value: Any) -> None:
        session = self.cuts.session
        if session is None:
            self.inner.agree(what, value)
        else:
            session.host(lambda: self.inner.agree(what, value), replay=False)

    def gather_object(self, obj: Any, root: int) -> list[Any] | None:
        session = self.cuts.session
        if session is None:
            return self.inner.gather_object(obj, root)
        return session.host(lambda: self.inner.gather_object(obj, root), replay=False)

    def dup(self) -> "CutComm":
        return CutComm(self.inner.dup(), self.cuts)


class Running:
    """A `Session` that runs each call as it comes and keeps nothing: a run checked for
    what a capture needs (no host-valued calls, every message completed) without
    capturing it."""

    def host(self, action: Callable[[], T], replay: bool = True) -> T:
        return action()
