"""The compiled phases of one level on one rank: each relaxation phase (and Phi at a set of
points) as one call of the propagator's compiled program (`CompiledPropagator`), built at
its first use and kept per program key, with the tensors the programs write into.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable, Hashable

import torch
from torch import Tensor

from .propagator import Step

if TYPE_CHECKING:
    from ..execute import Executor
    from .schedule import Schedule

# what a compiled phase is built from: its steps, per step (u, out, g), how many independent
PhaseSteps = tuple[list[Step], list[tuple[Tensor, Tensor, "Tensor | None"]], int]

_MISSING = object()


def _nothing() -> None:
    """The compiled phase of no steps (a rank's intervals without F-points)."""


class Phases:
    """Compiled phases of one level by name, with the propagator key they were built for,
    and their output buffers."""

    def __init__(self, index: int, like: Tensor) -> None:
        self.index = index
        self._state = (like.shape, like.dtype, like.device)
        self._programs: dict[Hashable, tuple[Hashable, Callable[[], None] | None]] = {}
        self._compiled: dict[tuple[Hashable, Hashable], Callable[[], None] | None] = {}
        self._buffers: dict[Hashable, Tensor] = {}
        # the solver's record of the cycle being recorded (`mgrit.core.schedule`), else
        # None: the programs returned while it is set record their calls in it
        self.recorder: Schedule | None = None

    def program(self, name: Hashable, executor: "Executor", parallel: int,
                build: Callable[[], PhaseSteps]) -> Callable[[], None] | None:
        """Phase `name` of this level, `parallel` of whose steps are independent, as one
        compiled call of the propagator (`CompiledPropagator`), built by `build` at its
        first use and again when the propagator's key changes (a phase of no steps is a
        call that does nothing); None where the phase runs step by step (no compiled
        phases, CUDA graphs, another executor, or the propagator declines). While a cycle
        is recorded, the program returned records its calls."""
        caps = executor.caps
        if (caps.program_key is None or caps.step_program is None or not executor.compiles
                or executor.graphs is not None):
            return None
        key = caps.program_key(self.index, parallel)
        rec = self.recorder
        if rec is not None:
            rec.key(self.index, parallel, key)
        if key is None:
            return None
        entry = self._programs.get(name)
        if entry is None or (entry[0] is not key and entry[0] != key):
            # a phase may alternate between keys (the fine level's final sweep keeps op
            # outputs, its other sweeps do not): every key's program is kept
            program = self._compiled.get((name, key), _MISSING)
            if program is _MISSING:
                steps, rows, parallel = build()
                program = self._compiled[(name, key)] = (
                    caps.step_program(steps, rows, parallel) if steps else _nothing)
            entry = self._programs[name] = (key, program)
        program = entry[1]
        if rec is not None:
            if program is None:
                rec.replayable = False
            elif not rec.depth and program is not _nothing:
                return partial(rec.call, program)
        return program

    def step_by_step(self) -> None:
        """A phase of this level runs step by step: the cycle being recorded, if any, is
        not replayable."""
        if self.recorder is not None:
            self.recorder.replayable = False

    def buffer(self, name: Hashable, count: int) -> Tensor:
        """A tensor of `count` states kept for phase `name`'s output (allocated once)."""
        buf = self._buffers.get(name)
        if buf is None:
            shape, dtype, device = self._state
            buf = self._buffers[name] = torch.empty((count, *shape), dtype=dtype,
                                                    device=device)
        return buf
