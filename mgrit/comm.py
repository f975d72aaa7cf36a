"""Moving states between ranks. The numerical core only talks to a `Comm`."""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor


class Request(Protocol):
    def wait(self) -> None: ...


class Comm(Protocol):
    """Point-to-point buffer messages of contiguous tensors and a few collectives."""

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


def as_comm(comm: Any) -> Comm:
    """None gives the serial communicator; a `Comm` is used as it is."""
    if comm is None:
        return SerialComm()
    if hasattr(comm, "allreduce_sum") and hasattr(comm, "irecv"):
        return comm
    raise TypeError(f"comm must be None or a mgrit communicator, got {type(comm).__name__}")
