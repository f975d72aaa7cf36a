"""How the independent intervals of one level are advanced: a loop, one batched call, or
groups of intervals on separate CUDA streams; and CUDA graphs of whole relaxation sweeps."""

from __future__ import annotations

from typing import Any, Callable, Hashable, Protocol

import torch
from torch import Tensor

from .propagator import Propagator, StepBatch, has_batched_step


class Executor(Protocol):
    graphs: "SweepGraphs | None"     # where relaxation sweeps may be captured (cuda_graphs)

    def advance(self, prop: Propagator, states: Tensor, steps: StepBatch) -> Tensor:
        """Return the stacked states after steps[i] applied to states[i]."""
        ...

    def advance_into(self, prop: Propagator, states: Tensor, steps: StepBatch, out: Tensor,
                     g: Tensor | None) -> None:
        """Write g + (the states after the steps) into `out` (g None: no g)."""
        ...


def write_result(out: Tensor, value: Tensor, g: Tensor | None) -> None:
    """out = g + value (g None: value), in place."""
    if g is None:
        out.copy_(value)
    else:
        torch.add(g, value, out=out)


def _check_output(out: object, states: Tensor, how: str) -> Tensor:
    if not isinstance(out, Tensor) or out.shape != states.shape or out.dtype != states.dtype:
        got = (f"shape {tuple(out.shape)}, dtype {out.dtype}" if isinstance(out, Tensor)
               else type(out).__name__)
        raise TypeError(f"propagator {how} returned {got}; expected shape "
                        f"{tuple(states.shape)}, dtype {states.dtype}")
    return out


class LoopExecutor:
    """One `step` call per interval: the reference path."""

    name = "loop"
    graphs: "SweepGraphs | None" = None

    def advance(self, prop: Propagator, states: Tensor, steps: StepBatch) -> Tensor:
        out = torch.stack([prop.step(states[i], s) for i, s in enumerate(steps)])
        return _check_output(out, states, "step")

    def advance_into(self, prop: Propagator, states: Tensor, steps: StepBatch, out: Tensor,
                     g: Tensor | None) -> None:
        write_result(out, self.advance(prop, states, steps), g)


def _single_step(prop: Propagator, steps: StepBatch) -> Callable[..., None] | None:
    """The propagator's single-step `step_into` for a batch of one interval (a rank that
    holds one interval of a coarse level), where it has one; else None. A batch of one
    costs a batch's overhead for one step's work."""
    return getattr(prop, "step_into", None) if len(steps) == 1 else None


class BatchedExecutor:
    """One `step_batch` call for all intervals; a batch of one interval through
    `_single_step`."""

    name = "batched"
    graphs: "SweepGraphs | None" = None

    def advance(self, prop: Propagator, states: Tensor, steps: StepBatch) -> Tensor:
        single = _single_step(prop, steps)
        if single is not None:
            out = torch.empty_like(states)
            single(states[0], steps[0], out[0], None)
            return out
        return _check_output(prop.step_batch(states, steps), states, "step_batch")

    def advance_into(self, prop: Propagator, states: Tensor, steps: StepBatch, out: Tensor,
                     g: Tensor | None) -> None:
        """Through the propagator's `step_batch_into` when it has one (no stacked temporary
        and no copy), else `step_batch` and a copy."""
        single = _single_step(prop, steps)
        if single is not None:
            single(states[0], steps[0], out[0], None if g is None else g[0])
            return
        into = getattr(prop, "step_batch_into", None)
        if into is not None:
            into(states, steps, out, g)
        else:
            write_result(out, self.advance(prop, states, steps), g)


class StreamExecutor:
    """Intervals in `groups` round-robin groups, each group's steps on its own CUDA stream,
    so independent intervals overlap on a GPU that one narrow step cannot fill. The caller's
    stream waits for all groups (an event per group) before the results are used. On a CPU
    this is the loop executor."""

    name = "streams"
    graphs = None

    def __init__(self, groups: int = 4) -> None:
        self.groups = groups
        self._streams: dict[torch.device, list] = {}

    def advance(self, prop: Propagator, states: Tensor, steps: StepBatch) -> Tensor:
        if states.device.type != "cuda":
            return LoopExecutor().advance(prop, states, steps)
        device = states.device
        if device not in self._streams:
            self._streams[device] = [torch.cuda.Stream(device) for _ in range(self.groups)]
        caller = torch.cuda.current_stream(device)
        out = torch.empty_like(states)
        for g, stream in enumerate(self._streams[device]):
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                for i in range(g, len(steps), self.groups):
                    out[i] = prop.step(states[i], steps[i])
            states.record_stream(stream)
            out.record_stream(stream)
        for stream in self._streams[device]:
            caller.wait_stream(stream)
        return _check_output(out, states, "step")

    def advance_into(self, prop: Propagator, states: Tensor, steps: StepBatch, out: Tensor,
                     g: Tensor | None) -> None:
        write_result(out, self.advance(prop, states, steps), g)


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

    `run(key, like, prop, sweep)` runs `sweep` (a function of tensor work only: no
    communication, no host reads, no Python state that a later call needs) eagerly on its
    first use, as the warm-up that capturing needs (library handles, workspaces, cached
    views), captures it on its second and replays the graph from then on (`capture`:
    `CudaCapture`, or a stand-in with its methods `warm_up` and `capture`). A graph
    replays the kernels on the memory they were captured with, so it is kept only while the
    propagator's `graph_key()` stays the same (its parameters' storage: a conversion such as
    `.double()` moves it) and not used while that key is None (the propagator is doing
    something a replay would skip, such as keeping outputs for the backward pass). States on
    another device than CUDA, or a propagator without `graph_key`, run eagerly.
    """

    device_types: tuple[str, ...] = ("cuda",)

    def __init__(self, capture: Any = None) -> None:
        self._capture = capture if capture is not None else CudaCapture()
        # sweep key -> [propagator's graph key, uses so far, graph or None]
        self._sweeps: dict[Hashable, list] = {}
        self.captured = 0
        self.replayed = 0

    def run(self, key: Hashable, like: Tensor, prop: Propagator, sweep: Callable[[], None]
            ) -> None:
        graph_key = getattr(prop, "graph_key", None)
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


def make_executor(execution: str, prop: Propagator, cuda_graphs: bool = False) -> Executor:
    """The executor that Config.execution asks for (with `SweepGraphs` for cuda_graphs)."""
    batched = has_batched_step(prop)
    if execution == "batched" and not batched:
        raise ValueError(f"execution='batched' needs a propagator with step_batch; "
                         f"{type(prop).__name__} has none")
    if execution == "streams":
        if cuda_graphs:
            raise ValueError("cuda_graphs needs the loop or batched executor, not 'streams'")
        return StreamExecutor()
    executor: Executor = (LoopExecutor() if execution == "loop" or not batched
                          else BatchedExecutor())
    if cuda_graphs:
        executor.graphs = SweepGraphs()
    return executor
