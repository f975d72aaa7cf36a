"""Ghost layers: copies of other ranks' layers that a rank's coarse steps use (a coarse step
uses the layer where it starts, which another rank may own). Which layer goes from which
rank to which follows from the grids alone (`coarse_layer_needs`); the copies are sent
again before every forward pass, since the optimizer changes the layers in between."""

from __future__ import annotations

from typing import Any

import torch

from ...comm import Comm, recv_init, send_init
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
        # (the layers' dtype and device, the messages made for them), made at first use
        self._messages: tuple[tuple, tuple[list, list]] | None = None

    def refresh(self) -> None:
        """Copy the layers other ranks' coarse steps need to them (after every update)."""
        if not (self.sends or self.recvs):
            return
        where = placement(self.layers)
        if self._messages is None or self._messages[0] != where:
            self._messages = (where, self._prepare(*where))
        _, (sends, recvs) = self._messages
        started = [message.start() for _, _, message in recvs]
        for layer, views, message in sends:
            for k, source in self.layers.views(layer).items():
                views[k].copy_(source)
            started.append(message.start())
        for request in started:
            request.wait()
        for layer, views, _ in recvs:
            self.layers.set_ghost(layer, views)

    def _prepare(self, dtype: torch.dtype, device: torch.device) -> tuple[list, list]:
        """The exchange's messages, posted anew at every refresh from buffers made once:
        (layer, the buffer's views by tensor name, persistent message) for the sends and
        for the receives. Made again where the layers move to another dtype or device."""
        comm, size = self.comm, self.layers.flat_size()

        def messages(entries: list[tuple[int, int, int]], init: Any) -> list[tuple]:
            out = []
            for tag, layer, peer in entries:
                buf = torch.zeros(size, dtype=dtype, device=device)
                out.append((layer, self.layers.flat_views(buf), init(comm, buf, peer, tag)))
            return out
        return messages(self.sends, send_init), messages(self.recvs, recv_init)
