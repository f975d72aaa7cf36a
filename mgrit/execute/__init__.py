"""How independent work inside one rank runs: the intervals of a level advanced by a loop
of single steps or by one batched call, CUDA graphs of whole relaxation sweeps, and the host
memory the process keeps between steps (`hold_freed_memory`). The solver asks
`make_executor` for the one that `Config.execution` names and never touches a device API
itself."""

from __future__ import annotations

from ..core.propagator import Capabilities
from .executors import BatchedExecutor, Executor, LoopExecutor, write_result
from .graphs import CudaCapture, SweepGraphs
from .host_memory import hold_freed_memory

__all__ = ["BatchedExecutor", "CudaCapture", "Executor", "LoopExecutor", "SweepGraphs",
           "hold_freed_memory", "make_executor", "write_result"]


def make_executor(execution: str, caps: Capabilities, cuda_graphs: bool = False,
                  name: str = "the propagator") -> Executor:
    """The executor that Config.execution asks for, for the propagator whose capabilities
    are `caps` (`name` names it in errors), with `SweepGraphs` for cuda_graphs."""
    batched = caps.step_batch is not None
    if execution == "batched" and not batched:
        raise ValueError(f"execution='batched' needs a propagator with step_batch; "
                         f"{name} has none")
    executor: Executor = (LoopExecutor(caps) if execution == "loop" or not batched
                          else BatchedExecutor(caps))
    if cuda_graphs:
        executor.graphs = SweepGraphs(caps)
    return executor
