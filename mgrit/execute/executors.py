"""The executor protocol and the two host executors: one `step` call per interval (the
reference) and one batched call for all intervals of a level."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from ..core.propagator import Capabilities, StepBatch

if TYPE_CHECKING:
    from .graphs import SweepGraphs


class Executor(Protocol):
    """Advances independent intervals of one level for the propagator it was made for."""

    caps: Capabilities
    graphs: "SweepGraphs | None"     # where relaxation sweeps may be captured (cuda_graphs)
    compiles: bool                   # whether relaxation phases may run as compiled calls

    def advance(self, states: Tensor, steps: StepBatch) -> Tensor:
        """Return the stacked states after steps[i] applied to states[i]."""
        ...

    def advance_into(self, states: Tensor, steps: StepBatch, out: Tensor,
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
    compiles = False

    def __init__(self, caps: Capabilities) -> None:
        self.caps = caps
        self.graphs: SweepGraphs | None = None

    def advance(self, states: Tensor, steps: StepBatch) -> Tensor:
        step = self.caps.step
        out = torch.stack([step(states[i], s) for i, s in enumerate(steps)])
        return _check_output(out, states, "step")

    def advance_into(self, states: Tensor, steps: StepBatch, out: Tensor,
                     g: Tensor | None) -> None:
        write_result(out, self.advance(states, steps), g)


class BatchedExecutor:
    """One `step_batch` call for all intervals (through `step_batch_into` where the
    propagator has it: no stacked temporary and no copy). A batch of one interval goes to
    the propagator's single-step `step_into` where it has one: a batch's overhead for one
    step's work is what a rank holding one interval of a coarse level would pay."""

    name = "batched"
    compiles = True      # a propagator's compiled phases replace its batched calls

    def __init__(self, caps: Capabilities) -> None:
        if caps.step_batch is None:
            raise ValueError("the batched executor needs a propagator with step_batch")
        self.caps = caps
        self.graphs: SweepGraphs | None = None
        self._batch, self._batch_into = caps.step_batch, caps.step_batch_into
        self._into = caps.step_into

    def advance(self, states: Tensor, steps: StepBatch) -> Tensor:
        if self._into is not None and len(steps) == 1:
            out = torch.empty_like(states)
            self._into(states[0], steps[0], out[0], None)
            return out
        return _check_output(self._batch(states, steps), states, "step_batch")

    def advance_into(self, states: Tensor, steps: StepBatch, out: Tensor,
                     g: Tensor | None) -> None:
        if self._into is not None and len(steps) == 1:
            self._into(states[0], steps[0], out[0], None if g is None else g[0])
        elif self._batch_into is not None:
            self._batch_into(states, steps, out, g)
        else:
            write_result(out, self.advance(states, steps), g)
