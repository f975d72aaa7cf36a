"""Launching programs under mpiexec."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def mpiexec() -> str:
    """$MGRIT_MPIEXEC, else the mpiexec beside this Python (MPICH from PyPI), else PATH's."""
    configured = os.environ.get("MGRIT_MPIEXEC")
    if configured:
        return configured
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise SystemExit("no mpiexec found; set MGRIT_MPIEXEC")
    return found


def _free_port() -> int:
    """A TCP port nobody listens on now, for the gloo baselines' rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
