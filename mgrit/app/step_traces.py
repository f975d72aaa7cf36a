"""Traces of training steps (`[output] trace = K`): the messages and compute of steps
2..K+1 of the first epoch a process runs (the first step is a warm-up), gathered from
every rank into OUT/trace.json for `mgrit replay`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..comm import SerialComm
from ..comm.mpi import MPIComm
from ..comm.tracing import Tracer, TracingComm


class StepTraces:
    """Records the traced steps of a run on the ranks of `world` (or None)."""

    def __init__(self, steps: int, world: Any, out: Path, settings: dict[str, Any]) -> None:
        self.steps = steps
        self.world = world
        self.out = out
        self.settings = settings
        self.tracer = Tracer()
        self.seconds: list[float] = []

    def comm(self, layer_comm: Any) -> TracingComm:
        """The layer communicator (an mpi4py one, or None when alone) that records."""
        inner = MPIComm(layer_comm) if layer_comm is not None else SerialComm()
        return TracingComm(inner, self.tracer)

    def begins(self, step: int) -> bool:
        """Whether the `step`th step this process runs is traced; the tracer starts at the
        first traced step."""
        if not 2 <= step <= self.steps + 1:
            return False
        if step == 2:
            self.tracer.start()
        return True

    def mark(self, name: str) -> None:
        self.tracer.mark(name)

    def done(self, k: int, seconds: float) -> None:
        """Traced step k done: mark it; after the last, gather every rank's trace and write
        OUT/trace.json on rank 0 (write, then rename)."""
        from .replay import save_traces

        self.tracer.mark(f"step{k}")
        self.seconds.append(seconds)
        if k < self.steps:
            return
        events = self.tracer.stop()
        traces = self.world.gather(events, root=0) if self.world is not None else [events]
        rank = self.world.Get_rank() if self.world is not None else 0
        if rank == 0:
            tmp = self.out / ".trace.json.tmp"
            save_traces(tmp, traces, ranks=len(traces), clock="wall", first_step=2,
                        step_seconds=self.seconds, settings=self.settings)
            tmp.replace(self.out / "trace.json")
