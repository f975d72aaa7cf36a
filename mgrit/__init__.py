"""Layer-parallel training of residual networks with multigrid reduction in time."""

# the one place the version is written: pyproject.toml reads it from here
__version__ = "0.1.0"

from .comm import split_world
from .core.config import Config
from .core.cycle import DivergenceError, Result, Solver, solve
from .core.propagator import Propagator, Step, StepBatch, step_sequentially
from .execute import hold_freed_memory
from .nn import Controller, LayerParallel, ResidualStep, serial_resnet

__all__ = [
    "Config",
    "Controller",
    "DivergenceError",
    "LayerParallel",
    "Propagator",
    "ResidualStep",
    "Result",
    "Solver",
    "Step",
    "StepBatch",
    "hold_freed_memory",
    "serial_resnet",
    "solve",
    "split_world",
    "step_sequentially",
]
