"""CUDA graphs of whole relaxation sweeps: captured at a sweep's second use, replayed
after, while the memory the sweep reads stays where it was."""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch
from torch import Tensor

from ..core.propagator import Capabilities


class CudaCapture:
    """Warm-up runs and captures of sweeps on one side stream per device: libraries create
    some handles lazily per stream (cuBLAS, cuBLASLt), and creating one while capturing
    fails, so a sweep is warmed up on the stream it is then captured on."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def warm_up(self, like: Tensor, sweep: Callable[[], None]) -> None:
        """Run `sweep` on the side stream, ordered after and before the caller's work."""
        stream, caller = self._stream(like.device), torch.cuda.current_stream(like.device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            sweep()
        caller.wait_stream(stream)

    def capture(self, like: Tensor, sweep: Callable[[], None]) -> Any:
        """A CUDA graph of `sweep`'s kernels (capturing runs none of them)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self._stream(like.device)):
            sweep()
        return graph


class SweepGraphs:
    """CUDA graphs of relaxation sweeps, one per sweep of a solver's level.

    `run(key, like, sweep)` runs `sweep` (a function of tensor work only: no
    communication, no host reads, no Python state that a later call needs) eagerly on its
    first use, as the warm-up that capturing needs (library handles, workspaces, cached
    views), captures it on its second and replays the graph from then on (`capture`:
    `CudaCapture`, or a stand-in with its methods `warm_up` and `capture`). A graph
    replays the kernels on the memory they were captured with, so it is kept only while the
    propagator's `graph_key()` (of its capabilities `caps`) stays the same (its parameters'
    storage: a conversion such as `.double()` moves it) and not used while that key is None
    (the propagator is doing something a replay would skip, such as keeping outputs for the
    backward pass). States on another device than CUDA, or a propagator without
    `graph_key`, run eagerly.
    """

    device_types: tuple[str, ...] = ("cuda",)

    def __init__(self, caps: Capabilities, capture: Any = None) -> None:
        self.caps = caps
        self._graph_key = caps.graph_key
        self._capture = capture if capture is not None else CudaCapture()
        # sweep key -> [propagator's graph key, uses so far, graph or None]
        self._sweeps: dict[Hashable, list] = {}
        self.captured = 0
        self.replayed = 0

    def run(self, key: Hashable, like: Tensor, sweep: Callable[[], None]) -> None:
        graph_key = self._graph_key
        token = (graph_key() if graph_key is not None and like.device.type in self.device_types
                 else None)
        if token is None:
            sweep()
            return
        entry = self._sweeps.get(key)
        if entry is None or entry[0] != token:
            entry = self._sweeps[key] = [token, 0, None]     # drops a stale graph
        entry[1] += 1
        if entry[1] == 1:
            self._capture.warm_up(like, sweep)
            return
        if entry[2] is None:
            entry[2] = self._capture.capture(like, sweep)
            self.captured += 1
        entry[2].replay()
        self.replayed += 1
