"""Groups of intervals on separate CUDA streams: independent intervals overlap on a GPU
that one narrow step cannot fill."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.propagator import Capabilities, StepBatch
from .executors import LoopExecutor, _check_output, write_result


class StreamExecutor:
    """Intervals in `groups` round-robin groups, each group's steps on its own CUDA stream,
    so independent intervals overlap on a GPU that one narrow step cannot fill. The caller's
    stream waits for all groups (an event per group) before the results are used. On a CPU
    this is the loop executor."""

    name = "streams"
    compiles = False
    graphs = None

    def __init__(self, caps: Capabilities, groups: int = 4) -> None:
        self.caps = caps
        self.groups = groups
        self._loop = LoopExecutor(caps)
        self._streams: dict[torch.device, list] = {}

    def advance(self, states: Tensor, steps: StepBatch) -> Tensor:
        if states.device.type != "cuda":
            return self._loop.advance(states, steps)
        step = self.caps.step
        device = states.device
        if device not in self._streams:
            self._streams[device] = [torch.cuda.Stream(device) for _ in range(self.groups)]
        caller = torch.cuda.current_stream(device)
        out = torch.empty_like(states)
        for g, stream in enumerate(self._streams[device]):
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                for i in range(g, len(steps), self.groups):
                    out[i] = step(states[i], steps[i])
            states.record_stream(stream)
            out.record_stream(stream)
        for stream in self._streams[device]:
            caller.wait_stream(stream)
        return _check_output(out, states, "step")

    def advance_into(self, states: Tensor, steps: StepBatch, out: Tensor,
                     g: Tensor | None) -> None:
        write_result(out, self.advance(states, steps), g)
