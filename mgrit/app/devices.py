"""The device a rank of a run trains on ([training] device). Under MPI several ranks of a
node share its GPUs: with `cuda` each takes the GPU of its index among the node's ranks,
modulo their number, so that one launch spreads over a node's GPUs without per-rank
settings."""

from __future__ import annotations

from typing import Any

import torch

from .settings import SettingsError


def node_rank(world: Any) -> int:
    """This rank's index among the ranks of `world` (an mpi4py communicator, or None) that
    share its node. Collective."""
    if world is None:
        return 0
    from mpi4py import MPI

    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def rank_device(setting: str, node_index: int, cuda: Any = torch.cuda) -> torch.device:
    """The device of [training] device = `setting` for the rank of index `node_index` on its
    node; `cuda` is torch.cuda (or what stands for it in a test). Raises SettingsError where
    this process cannot train there."""
    if setting == "cpu":
        return torch.device("cpu")
    where = f"[training] device = {setting!r}"
    if not cuda.is_available():
        build = torch.version.cuda
        why = (f"torch {torch.__version__} (CUDA {build}) finds no CUDA device here" if build
               else f"torch {torch.__version__} is built without CUDA")
        raise SettingsError(f"{where}: {why}; train with device = 'cpu'"
                            + ("" if build else " or install a CUDA build of torch"))
    count = cuda.device_count()
    if setting == "cuda":
        return torch.device("cuda", node_index % count)
    index = int(setting.split(":")[1])
    if index >= count:
        raise SettingsError(f"{where}: this node has {count} CUDA device(s), "
                            f"cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a step's time on a GPU is known after it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
