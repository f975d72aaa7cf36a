"""Layer-parallel training of residual networks with multigrid reduction in time."""

from .config import Config
from .cycle import DivergenceError, Result, Solver, solve
from .propagator import Propagator, Step, StepBatch, step_sequentially

__all__ = [
    "Config",
    "DivergenceError",
    "Propagator",
    "Result",
    "Solver",
    "Step",
    "StepBatch",
    "solve",
    "step_sequentially",
]
