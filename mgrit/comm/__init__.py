"""The communication seam: everything the solver and the network layer send between ranks
goes through a `Comm`. Implementations: one process (`SerialComm`), the same ranks numbered
backwards for the adjoint (`ReversedComm`), MPI (`mpi.MPIComm`, made by `as_comm` from an
mpi4py communicator), threads playing ranks (`virtual`), and a recorder of any of them
(`tracing`). Only `mpi` imports mpi4py, and only when it is used."""

from .base import (Comm, Persistent, Request, ReversedComm, SerialComm, as_comm, note_rank,
                   recv_init, send_init)
from .mpi import split_world

__all__ = ["Comm", "Persistent", "Request", "ReversedComm", "SerialComm", "as_comm",
           "note_rank", "recv_init", "send_init", "split_world"]
