"""The executor protocol and the two host executors: one `step` call per interval (the
reference) and one batched call for all intervals of a level."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import torch
from torch import Tensor

from ..core.propagator import Propagator, StepBatch

if TYPE_CHECKING:
    from .graphs import SweepGraphs


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
