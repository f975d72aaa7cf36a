"""Moving states between ranks. The numerical core only talks to a `Comm`."""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor


class Request(Protocol):
    def wait(self) -> None: ...


class Persistent(Protocol):
    """A message posted again and again with the same buffer, peer and tag (the boundary
    values of a level, every cycle): `start()` posts it and returns what to wait on. On
    MPI, a persistent request: the buffer and envelope are set up once, not at every send."""

    def start(self) -> Request: ...


class _Reposted:
    """A persistent message on a communicator without them: each start posts it anew."""

    __slots__ = ("post",)

    def __init__(self, post: Any) -> None:
        self.post = post

    def start(self) -> Request:
        return self.post()


def send_init(comm: "Comm", buf: Tensor, dest: int, tag: int) -> Persistent:
    """The send of `buf` to dest with tag as a persistent message (`Persistent`): the
    communicator's own (`Comm.send_init`, optional), else an isend at every start."""
    own = getattr(comm, "send_init", None)
    if own is not None:
        return own(buf, dest, tag)
    return _Reposted(lambda: comm.isend(buf, dest, tag))


def recv_init(comm: "Comm", buf: Tensor, source: int, tag: int) -> Persistent:
    """The receive into `buf` from source with tag as a persistent message (see
    `send_init`)."""
    own = getattr(comm, "recv_init", None)
    if own is not None:
        return own(buf, source, tag)
    return _Reposted(lambda: comm.irecv(buf, source, tag))


class Comm(Protocol):
    """Point-to-point buffer messages of contiguous tensors and a few collectives.
    Optional: `send_init(buf, dest, tag)` and `recv_init(buf, source, tag)`, persistent
    messages (`Persistent`; the module functions of those names fall back to isend and
    irecv)."""

    rank: int
    size: int

    def isend(self, buf: Tensor, dest: int, tag: int) -> Request: ...

    def irecv(self, buf: Tensor, source: int, tag: int) -> Request: ...

    def allreduce_sum(self, value: float) -> float: ...

    def bcast_(self, buf: Tensor, root: int) -> None:
        """Overwrite `buf` on every rank with root's `buf`."""
        ...

    def agree(self, what: str, value: Any) -> None:
        """Raise on every rank when `value` differs between ranks."""
        ...

    def dup(self) -> "Comm":
        """A communicator over the same ranks whose messages never mix with this one's."""
        ...

    def gather_object(self, obj: Any, root: int) -> list[Any] | None:
        """Every rank's `obj` on root (pickled: for set-up and export, not hot paths)."""
        ...

    def allreduce_sum_(self, buf: Tensor) -> None:
        """Sum `buf` over all ranks, in place."""
        ...


class SerialComm:
    """The one-rank communicator: nothing to exchange."""

    rank = 0
    size = 1

    def isend(self, buf: Tensor, dest: int, tag: int) -> Request:
        raise RuntimeError("a serial solve has no other rank to send to")

    def irecv(self, buf: Tensor, source: int, tag: int) -> Request:
        raise RuntimeError("a serial solve has no other rank to receive from")

    def allreduce_sum(self, value: float) -> float:
        return value

    def bcast_(self, buf: Tensor, root: int) -> None:
        return None

    def agree(self, what: str, value: Any) -> None:
        return None

    def dup(self) -> "SerialComm":
        return self

    def gather_object(self, obj: Any, root: int) -> list[Any]:
        return [obj]

    def allreduce_sum_(self, buf: Tensor) -> None:
        return None


class ReversedComm:
    """The same ranks numbered backwards (rank r is the inner rank size-1-r).

    The adjoint runs on the reversed time grid; numbering ranks backwards lets each
    rank keep the layers and forward states it already holds.
    """

    def __init__(self, inner: Comm) -> None:
        self.inner = inner
        self.size = inner.size
        self.rank = inner.size - 1 - inner.rank

    def _map(self, rank: int) -> int:
        return self.size - 1 - rank

    def isend(self, buf: Tensor, dest: int, tag: int) -> Request:
        return self.inner.isend(buf, self._map(dest), tag)

    def irecv(self, buf: Tensor, source: int, tag: int) -> Request:
        return self.inner.irecv(buf, self._map(source), tag)

    def send_init(self, buf: Tensor, dest: int, tag: int) -> Persistent:
        return send_init(self.inner, buf, self._map(dest), tag)

    def recv_init(self, buf: Tensor, source: int, tag: int) -> Persistent:
        return recv_init(self.inner, buf, self._map(source), tag)

    def allreduce_sum(self, value: float) -> float:
        return self.inner.allreduce_sum(value)

    def bcast_(self, buf: Tensor, root: int) -> None:
        self.inner.bcast_(buf, self._map(root))

    def agree(self, what: str, value: Any) -> None:
        self.inner.agree(what, value)

    def dup(self) -> "ReversedComm":
        return ReversedComm(self.inner.dup())

    def gather_object(self, obj: Any, root: int) -> list[Any] | None:
        gathered = self.inner.gather_object(obj, self._map(root))
        return None if gathered is None else gathered[::-1]

    def allreduce_sum_(self, buf: Tensor) -> None:
        self.inner.allreduce_sum_(buf)


def note_rank(err: Exception, comm: "Comm") -> None:
    """Name the rank in an error raised on one of several ranks (a note on the exception):
    with every rank failing alike or one alone, the traceback says which it came from."""
    if comm.size > 1:
        err.add_note(f"mgrit: raised on rank {comm.rank} of {comm.size}")


def innermost(comm: Any) -> Any:
    """The communicator under the wrappers (`ReversedComm`, a cut or a tracing one) that
    pass every call to an `inner` one."""
    while hasattr(comm, "inner"):
        comm = comm.inner
    return comm


def as_comm(comm: Any) -> Comm:
    """None gives the serial communicator, an mpi4py communicator an `MPIComm`;
    a `Comm` is used as it is."""
    if comm is None:
        return SerialComm()
    if hasattr(comm, "allreduce_sum") and hasattr(comm, "irecv"):
        return comm
    if type(comm).__module__.startswith("mpi4py"):
        from .mpi import MPIComm

        return MPIComm(comm)
    raise TypeError(f"comm must be None, an mpi4py communicator or a mgrit communicator, "
                    f"got {type(comm).__name__}")
