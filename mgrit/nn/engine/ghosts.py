"""Ghost layers: copies of other ranks' layers that a rank's coarse steps use (a coarse step
uses the layer where it starts, which another rank may own). Which layer goes from which
rank to which follows from the grids alone (`coarse_layer_needs`); the copies are sent
again before every forward pass, since the optimizer changes the layers in between."""

from __future__ import annotations

import torch

from ...comm import Comm
from ...core.grid import LevelGrid, coarse_layer_needs
from .stack import LayerStack


def placement(layers: LayerStack) -> tuple[torch.dtype, torch.device]:
    """The dtype and device of a rank's layer tensors (the default dtype on the CPU for a
    rank whose step module has no tensors)."""
    tensors = list(layers.tensors().values())
    if not tensors:
        return torch.get_default_dtype(), torch.device("cpu")
    return tensors[0].dtype, tensors[0].device


class GhostExchange:
    """Sends this rank's layers that other ranks' coarse steps need, and receives the ones
    its own coarse steps need into `layers.ghosts`.

    grids:  the forward solver's level grids; blocks: the ranks' level-0 blocks.
    comm:   the layer-parallel group; the exchange uses a duplicate of its own, so its
            messages never match the solves'.
    """

    def __init__(self, layers: LayerStack, grids: list[LevelGrid],
                 blocks: list[tuple[int, int]], comm: Comm) -> None:
        self.layers = layers
        self.blocks = blocks
        self.comm = comm.dup()
        self.set_grids(grids)

    def set_grids(self, grids: list[LevelGrid]) -> None:
        """Exchange what the coarse steps of the forward solver on `grids` need (another
        hierarchy over the same blocks needs other layers)."""
        rank = self.comm.rank
        needs = coarse_layer_needs(grids, self.blocks)
        # (message tag, layer, rank it goes to / comes from)
        self.sends = [(tag, layer, r) for tag, (r, layer, owner) in enumerate(needs)
                      if owner == rank]
        self.recvs = [(tag, layer, owner) for tag, (r, layer, owner) in enumerate(needs)
                      if r == rank]

    def refresh(self) -> None:
        """Copy the layers other ranks' coarse steps need to them (after every update)."""
        comm = self.comm
        requests, received = [], []
        for tag, layer, owner in self.recvs:
            dtype, device = placement(self.layers)
            buf = torch.empty(self.layers.flat_size(), dtype=dtype, device=device)
            requests.append(comm.irecv(buf, owner, tag))
            received.append((layer, buf))
        for tag, layer, dest in self.sends:
            requests.append(comm.isend(self.layers.flatten_layer(layer).contiguous(), dest, tag))
        for req in requests:
            req.wait()
        for layer, buf in received:
            self.layers.set_ghost(layer, buf)
