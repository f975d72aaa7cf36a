"""Layer-parallel training of residual networks with multigrid reduction in time."""

from .comm import split_world
from .config import Config
from .cycle import DivergenceError, Result, Solver, solve
from .nn import LayerParallel, ResidualStep, serial_resnet
from .propagator import Propagator, Step, StepBatch, step_sequentially

__all__ = [
    "Config",
    "DivergenceError",
    "LayerParallel",
    "Propagator",
    "ResidualStep",
    "Result",
    "Solver",
    "Step",
    "StepBatch",
    "serial_resnet",
    "solve",
    "split_world",
    "step_sequentially",
]
