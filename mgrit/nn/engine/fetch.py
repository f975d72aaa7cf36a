"""What the gathered coarse levels of a layer-parallel solve read (`Config.agglomerate`):
every rank takes every step of those levels (`mgrit.core.agglomerate`), so before each
solve the layers of their steps, and for the adjoint the forward states where they
linearise, come to every rank. Each kind comes in one sum-reduction of one buffer, a row
per layer or point: the rank that owns a row writes it, every other rank adds -0.0, which
leaves the owner's bits (x + (-0.0) is x for every x, signed zeros and NaN included). What
a rank owns, and the views of the buffer that the steps read, are worked out once per
buffer: a fetch is then a fill, the rank's own rows and the reduction."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ...comm import Comm
from ...core.agglomerate import carried_dtype
from .stack import LayerStack


class RowFetch:
    """Rows of one kind, one per key (in the order of `keys`), each owned by one rank,
    brought to every rank by one reduction into `buffer`."""

    def __init__(self, keys: list[int], comm: Comm) -> None:
        self.keys = keys
        self.index = {key: i for i, key in enumerate(keys)}
        self.comm = comm
        self.buffer: Tensor | None = None

    def run(self, fill: Callable[[Tensor], None], width: int, like: Tensor) -> bool:
        """Row i of the buffer := key i's row, on every rank (`fill(buffer)` writes the rows
        this rank owns); True where the buffer was made anew."""
        dtype, device = carried_dtype(like.dtype), like.device
        buffer = self.buffer
        made = (buffer is None or buffer.shape[1] != width or buffer.dtype != dtype
                or buffer.device != device)
        if made:
            buffer = self.buffer = torch.empty((len(self.keys), width), dtype=dtype,
                                               device=device)
        buffer.fill_(-0.0)
        fill(buffer)
        self.comm.allreduce_sum_(buffer)
        return made

    def owned(self, mine: Callable[[int], bool]) -> tuple[slice, list[int]]:
        """(the buffer's rows of the keys for which `mine` is true, those keys): a run of
        consecutive rows, since the keys are sorted and a rank owns an interval of them."""
        keys = [key for key in self.keys if mine(key)]
        first = self.index[keys[0]] if keys else 0
        return slice(first, first + len(keys)), keys


class LayerFetch:
    """The layers of the gathered levels' steps, one fetch per `LayerStack` (`of`), whatever
    solver asks: every rank holds every such layer it does not own as a ghost whose tensors
    are views of the reduction's buffer, so a fetch is the rank's own rows, one reduction
    and no copy into the ghosts. The layers change at every optimizer step, so every
    forward solve fetches them again."""

    def __init__(self, stack: LayerStack) -> None:
        self.stack = stack
        self.layers: set[int] = set()
        self.rows: RowFetch | None = None
        # the buffer's rows of the layers this rank owns and their rows in its stacked
        # tensors; the ghosts installed as views of the buffer
        self._owned: tuple[slice, Tensor] | None = None
        self._ghosts: dict[int, dict[str, Tensor]] = {}
        # whether the layers added last have been fetched (every rank adds and fetches at
        # the same points of its program, so every rank reads the same)
        self.fresh = False

    @staticmethod
    def of(stack: LayerStack) -> "LayerFetch":
        """The stack's fetch, made at its first use."""
        fetch = stack.__dict__.get("_layer_fetch")
        if fetch is None:
            fetch = stack.__dict__["_layer_fetch"] = LayerFetch(stack)
        return fetch

    def add(self, layers: list[int], comm: Comm) -> None:
        """Fetch these layers too from now on (over `comm`'s ranks)."""
        if not set(layers) <= self.layers:
            self.layers |= set(layers)
            self.rows = RowFetch(sorted(self.layers), comm)
            self._owned, self._ghosts = None, {}
            self.fresh = False

    def run(self) -> None:
        stack, rows = self.stack, self.rows
        tensors = stack.tensors()
        if not tensors or rows is None:
            return
        like = next(iter(tensors.values()))
        lo, hi = stack.first, stack.last
        if self._owned is None or self._owned[1].device != like.device:
            where, layers = rows.owned(lambda n: lo <= n <= hi)
            self._owned = (where, torch.tensor([n - lo for n in layers], dtype=torch.long,
                                               device=like.device))

        def fill(buffer: Tensor) -> None:
            # every owned layer's tensors in one copy per name, not a copy per layer
            where, local = self._owned
            if not len(local):
                return
            for name, columns, _ in stack.flat_layout():
                buffer[where, columns].copy_(
                    tensors[name].detach().index_select(0, local).reshape(len(local), -1))
        if rows.run(fill, stack.flat_size(), like):
            self._ghosts = {}
        self.fresh = True
        buffer = rows.buffer
        others = [(n, i) for n, i in rows.index.items() if not lo <= n <= hi]
        if buffer.dtype != like.dtype:
            # carried in float64: the ghosts keep tensors of their own
            for layer, i in others:
                stack.set_ghost(layer, {k: v.to(like.dtype) for k, v in
                                        stack.flat_views(buffer[i]).items()})
            return
        ghosts = stack.ghosts
        if self._ghosts and all(ghosts.get(n) is self._ghosts.get(n) for n, _ in others):
            return
        # the ghosts are views of the buffer from now on (made again where the buffer or
        # the stack's tensors changed): every later fetch writes them in place
        for layer, i in others:
            views = self._ghosts[layer] = stack.flat_views(buffer[i])
            stack.install_ghost(layer, views)

    def stacked(self, layers: list[int]) -> dict[str, Tensor] | None:
        """The fetched `layers` (all of them fetched, in increasing order) as stacked
        tensors by name, views of the buffer (each layer's entries contiguous, layers a row
        apart); None where the buffer's dtype is not the layers' or they are not a run of
        consecutive rows."""
        rows, stack = self.rows, self.stack
        buffer = None if rows is None else rows.buffer
        tensors = stack.tensors()
        if buffer is None or not tensors or buffer.dtype != next(iter(tensors.values())).dtype:
            return None
        first = rows.index[layers[0]]
        if [rows.index[n] for n in layers] != list(range(first, first + len(layers))):
            return None
        block = buffer[first: first + len(layers)]
        return {name: block[:, columns].unflatten(1, shape)
                for name, columns, shape in stack.flat_layout()}


class StateFetch:
    """The forward states at the points where the adjoint's gathered steps linearise, on
    every rank: `states[point]` after `run`, and all of them as `stacked`."""

    def __init__(self, points: list[int], comm: Comm) -> None:
        self.rows = RowFetch(points, comm)
        self.states: dict[int, Tensor] = {}
        self.stacked: Tensor | None = None
        self._views: dict[int, Tensor] | None = None
        # (offset, rows) the owned rows were found for: the buffer's rows of the points this
        # rank owns, and their rows in its states
        self._owned: tuple[int, int, slice, Tensor] | None = None

    def run(self, states: Tensor, offset: int) -> None:
        """`states`: this rank's level-0 forward storage, row i holding point offset + i;
        row 0 is the ghost, a copy of the previous rank's last point, which that rank
        sends (two senders would sum to twice the state)."""
        count = len(states)
        if (self._owned is None or self._owned[:2] != (offset, count)
                or self._owned[3].device != states.device):
            where, points = self.rows.owned(lambda p: 1 <= p - offset < count)
            self._owned = (offset, count, where,
                           torch.tensor([p - offset for p in points], dtype=torch.long,
                                        device=states.device))
        like = states[0]
        _, _, where, local = self._owned

        def fill(buffer: Tensor) -> None:
            if len(local):
                buffer[where].copy_(states.index_select(0, local).reshape(len(local), -1))
        made = self.rows.run(fill, like.numel(), like)
        buffer = self.rows.buffer
        if made or self._views is None:
            # views of the buffer, which every later fetch into it refreshes
            self.stacked = buffer.view(len(buffer), *like.shape)
            self._views = {point: self.stacked[i] for point, i in self.rows.index.items()}
        if buffer.dtype == like.dtype:
            self.states = self._views
        else:
            self.states = {point: state.to(like.dtype) for point, state in self._views.items()}
            self.stacked = None
