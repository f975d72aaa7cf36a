"""How the independent intervals of one level are advanced: a loop or one batched call."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from .propagator import Propagator, StepBatch, has_batched_step


class Executor(Protocol):
    def advance(self, prop: Propagator, states: Tensor, steps: StepBatch) -> Tensor:
        """Return the stacked states after steps[i] applied to states[i]."""
        ...


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

    def advance(self, prop: Propagator, states: Tensor, steps: StepBatch) -> Tensor:
        out = torch.stack([prop.step(states[i], s) for i, s in enumerate(steps)])
        return _check_output(out, states, "step")


class BatchedExecutor:
    """One `step_batch` call for all intervals."""

    name = "batched"

    def advance(self, prop: Propagator, states: Tensor, steps: StepBatch) -> Tensor:
        return _check_output(prop.step_batch(states, steps), states, "step_batch")


def make_executor(execution: str, prop: Propagator) -> Executor:
    """The executor that Config.execution asks for."""
    batched = has_batched_step(prop)
    if execution == "batched" and not batched:
        raise ValueError(f"execution='batched' needs a propagator with step_batch; "
                         f"{type(prop).__name__} has none")
    if execution == "loop" or not batched:
        return LoopExecutor()
    return BatchedExecutor()
