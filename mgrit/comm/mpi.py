"""The MPI communicator: mpi4py buffer messages of contiguous tensors, never pickled, and
the split of a world into layer-parallel groups times data-parallel replicas."""

from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .base import _Reposted


def _as_buffer(t: Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, shared with it (no copy), for any dtype."""
    if t.device.type != "cpu":
        raise ValueError(f"MPI buffers must be CPU tensors here, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("MPI buffers must be contiguous tensors")
    return t.detach().reshape(-1).view(torch.uint8).numpy()


class _MPIRequest:
    __slots__ = ("req", "buf", "done")

    def __init__(self, req: Any, buf: Any, done: Any = None) -> None:
        self.req = req
        self.buf = buf    # keeps the memory alive while the message is in flight
        self.done = done  # what to do once it has arrived (copy a staged receive to the GPU)

    def wait(self) -> None:
        self.req.Wait()
        if self.done is not None:
            self.done()
            self.done = None


_FREE_REGISTERED = False


def _register_free() -> None:
    """Run `_free_persistent` at exit, before mpi4py finalizes MPI (exit functions run in
    the reverse order of registration, and mpi4py registers its own when it is imported,
    which is before this)."""
    global _FREE_REGISTERED
    if not _FREE_REGISTERED:
        atexit.register(_free_persistent)
        _FREE_REGISTERED = True


class _MPIPersistent:
    """An MPI persistent request (MPI_Send_init / MPI_Recv_init): the buffer and envelope
    are set up once; every start posts the message again (mpi4py's Isend would parse the
    buffer and build a request at every call, several times MPI's own cost of a small
    message). Freed when dropped, or before MPI is finalized (`_free_persistent`)."""

    __slots__ = ("req", "buf", "__weakref__")

    def __init__(self, req: Any, buf: Any) -> None:
        self.req = req
        self.buf = buf    # keeps the memory alive: MPI reads and writes it at every start
        _PERSISTENT.add(self)

    def start(self) -> "_MPIPersistent":
        self.req.Start()
        return self

    def wait(self) -> None:
        self.req.Wait()

    def free(self) -> None:
        if not self.req:
            # freed already (by `_free_persistent` at exit): at interpreter shutdown,
            # where `__del__` runs last, not even an import works
            return
        from mpi4py import MPI

        if not MPI.Is_finalized():
            self.req.Wait()       # a started request completes before it is freed
            self.req.Free()

    def __del__(self) -> None:
        self.free()


_PERSISTENT: "weakref.WeakSet[_MPIPersistent]" = weakref.WeakSet()


def _free_persistent() -> None:
    """Free every persistent request still alive before MPI is finalized (MPICH names each
    one it finds unfreed at finalization)."""
    for request in list(_PERSISTENT):
        request.free()


_ABORT_HOOK_INSTALLED = False


def _install_abort_hook() -> None:
    """Make an uncaught exception on any rank print its traceback and abort every rank.

    `python -m mpi4py script.py` does the same; this covers plain `python script.py`
    launches, where one failed rank would otherwise leave the others waiting forever.
    """
    global _ABORT_HOOK_INSTALLED
    if _ABORT_HOOK_INSTALLED:
        return
    from mpi4py import MPI

    previous = sys.excepthook

    def hook(exc_type, exc, tb):  # pragma: no cover - runs only while a rank dies
        previous(exc_type, exc, tb)
        sys.stderr.flush()
        time.sleep(1.0)  # let the launcher forward the traceback before it tears the job down
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook
    _ABORT_HOOK_INSTALLED = True


class MPIComm:
    """An mpi4py communicator: buffer messages of contiguous tensors, never pickled.

    GPU tensors go directly from device memory when the MPI is CUDA-aware (say so with
    `cuda_aware=True` or MGRIT_CUDA_AWARE_MPI=1), otherwise through a host copy. On one
    rank the collectives make no MPI call and no copy.
    """

    def __init__(self, comm: Any, cuda_aware: bool | None = None) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.cuda_aware = (os.environ.get("MGRIT_CUDA_AWARE_MPI") == "1" if cuda_aware is None
                           else cuda_aware)
        # the thread support MPI was started with, named where it confines the calls to one
        # thread: on CUDA autograd runs a backward pass, and the adjoint's messages in it, on
        # a thread of its own (`mgrit.nn.checks.check_backward_thread`)
        level = MPI.Query_thread()
        self.one_thread_only = (None if level >= MPI.THREAD_SERIALIZED else
                                "MPI_THREAD_SINGLE" if level == MPI.THREAD_SINGLE else
                                "MPI_THREAD_FUNNELED")
        _install_abort_hook()
        _register_free()

    def _device_buffer(self, t: Tensor) -> Any:
        """A CUDA tensor's bytes for a CUDA-aware MPI, once its pending kernels are done."""
        torch.cuda.current_stream(t.device).synchronize()
        return [t.detach().reshape(-1).view(torch.uint8), self._mpi.BYTE]

    def isend(self, buf: Tensor, dest: int, tag: int) -> _MPIRequest:
        if buf.device.type == "cuda":
            if self.cuda_aware:
                data = self._device_buffer(buf)
                return _MPIRequest(self.comm.Isend(data, dest=dest, tag=tag), data)
            buf = buf.detach().cpu()
        data = _as_buffer(buf)
        return _MPIRequest(self.comm.Isend([data, self._mpi.BYTE], dest=dest, tag=tag), data)

    def send_init(self, buf: Tensor, dest: int, tag: int) -> Any:
        """A persistent send of `buf` (see `mgrit.comm.base.Persistent`); a CUDA tensor
        goes through `isend` at every start."""
        if buf.device.type == "cuda":
            return _Reposted(lambda: self.isend(buf, dest, tag))
        data = _as_buffer(buf)
        return _MPIPersistent(self.comm.Send_init([data, self._mpi.BYTE], dest=dest, tag=tag),
                              data)

    def recv_init(self, buf: Tensor, source: int, tag: int) -> Any:
        """A persistent receive into `buf` (see `send_init`)."""
        if buf.device.type == "cuda":
            return _Reposted(lambda: self.irecv(buf, source, tag))
        data = _as_buffer(buf)
        return _MPIPersistent(self.comm.Recv_init([data, self._mpi.BYTE], source=source,
                                                  tag=tag), data)

    def irecv(self, buf: Tensor, source: int, tag: int) -> _MPIRequest:
        if buf.device.type == "cuda":
            if self.cuda_aware:
                data = self._device_buffer(buf)
                return _MPIRequest(self.comm.Irecv(data, source=source, tag=tag), data)
            host = torch.empty(buf.shape, dtype=buf.dtype)
            data = _as_buffer(host)
            return _MPIRequest(self.comm.Irecv([data, self._mpi.BYTE], source=source, tag=tag),
                               data, done=lambda: buf.copy_(host))
        data = _as_buffer(buf)
        return _MPIRequest(self.comm.Irecv([data, self._mpi.BYTE], source=source, tag=tag), data)

    def allreduce_sum(self, value: float) -> float:
        if self.size == 1:
            return float(value)
        send = np.array([value], dtype=np.float64)
        recv = np.empty(1, dtype=np.float64)
        self.comm.Allreduce(send, recv, op=self._mpi.SUM)
        return float(recv[0])

    def bcast_(self, buf: Tensor, root: int) -> None:
        if self.size == 1:
            return
        host = buf.detach().cpu() if buf.device.type == "cuda" else buf
        self.comm.Bcast([_as_buffer(host), self._mpi.BYTE], root=root)
        if host is not buf:
            buf.copy_(host)

    def agree(self, what: str, value: Any) -> None:
        if self.size == 1:
            return
        values = self.comm.allgather(value)
        differing = [r for r, v in enumerate(values) if v != values[0]]
        if differing:
            shown = "; ".join(f"rank {r}: {values[r]!r}" for r in [0] + differing[:3])
            raise ValueError(f"{what} differ between ranks ({shown}); every rank must pass "
                             "the same settings")

    def dup(self) -> "MPIComm":
        return MPIComm(self.comm.Dup())

    def gather_object(self, obj: Any, root: int) -> list[Any] | None:
        if self.size == 1:
            return [obj]
        return self.comm.gather(obj, root=root)

    def allreduce_sum_(self, buf: Tensor) -> None:
        # one rank: nothing to sum, and no host copy of a CUDA tensor, which a captured
        # step cannot hold (a communicator of one rank is not cut, `LayerParallel`)
        if self.size == 1:
            return
        host = buf.detach().cpu() if buf.device.type == "cuda" else buf.detach()
        self.comm.Allreduce(self._mpi.IN_PLACE, host.numpy(), op=self._mpi.SUM)
        if host.data_ptr() != buf.data_ptr():
            buf.copy_(host)


def split_world(world: Any, layer_parallel: int) -> tuple[Any, Any]:
    """Split an mpi4py communicator into layer-parallel groups of `layer_parallel` ranks
    times data-parallel replicas: returns (layer_comm, data_comm) for this rank.

    World rank w is rank w % layer_parallel of replica w // layer_parallel; data_comm joins
    the ranks that hold the same layers in every replica.
    """
    size = world.Get_size()
    if layer_parallel < 1 or size % layer_parallel:
        raise ValueError(f"layer_parallel={layer_parallel} must divide the {size} ranks")
    rank = world.Get_rank()
    layer_comm = world.Split(color=rank // layer_parallel, key=rank)
    data_comm = world.Split(color=rank % layer_parallel, key=rank)
    return layer_comm, data_comm
