"""Checks of a solve's problem before any work: the numbers, the initial value and guess,
one step of the propagator, and a tolerance the states' precision cannot reach."""

from __future__ import annotations

import cmath
import math
import warnings
from numbers import Real
from typing import Any

import torch
from torch import Tensor

from .config import Config
from .level import Level
from .propagator import Capabilities


def check_number(name: str, value: Any) -> float:
    """`value` as a float, if it is a finite real number."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite real number, got {value!r}")
    return float(value)



def warn_below_round_off(config: Config, dtype: torch.dtype) -> None:
    """A relative tolerance that the states' precision cannot reach is a wasted solve: the
    residual stalls at round-off and every one of max_iter cycles runs. Not an error (a
    caller may want max_iter cycles), so a warning, at construction."""
    if config.tol_kind != "relative" or config.tol == 0.0:
        return
    if not (dtype.is_floating_point or dtype.is_complex):
        return
    eps = torch.finfo(dtype).eps
    if config.tol < 10 * eps:
        warnings.warn(f"tol={config.tol:g} (relative) is below what {dtype} states resolve "
                      f"(machine epsilon {eps:.1e}): the residual stalls at round-off, the "
                      f"solve will not converge and runs all max_iter={config.max_iter} "
                      "cycles; use a tolerance above 10 epsilon or a wider dtype",
                      RuntimeWarning, stacklevel=3)


def check_guess(guess: Tensor, num_steps: int, shape: torch.Size, dtype: torch.dtype
                ) -> None:
    """An initial guess tensor holds every point of level 0 in the states' dtype."""
    expected = (num_steps + 1, *shape)
    if tuple(guess.shape) != expected or guess.dtype != dtype:
        raise ValueError(f"initial_guess tensor has shape {tuple(guess.shape)} and dtype "
                         f"{guess.dtype}; expected shape {expected} (num_steps + 1 points) "
                         f"and dtype {dtype}")


def check_u0(u0: Tensor, shape: torch.Size, dtype: torch.dtype, finite: bool = True) -> None:
    """u0 is a tensor of the solver's shape and dtype, and finite (where `finite`: the test
    reads a value on the host, which a captured solve leaves to its residual history)."""
    if not isinstance(u0, Tensor):
        raise TypeError(f"u0 must be a torch.Tensor, got {type(u0).__name__}")
    if u0.shape != shape or u0.dtype != dtype:
        raise ValueError(f"u0 has shape {tuple(u0.shape)} and dtype {u0.dtype}; this solver "
                         f"was built for shape {tuple(shape)} and dtype {dtype}")
    # a NaN or Inf anywhere makes the sum one (one reduction and a read, where the
    # exact test takes three calls); a sum of finite values may overflow, so a sum
    # that is not finite is checked entry by entry
    if finite and not cmath.isfinite(u0.sum().item()) and not bool(torch.isfinite(u0).all()):
        raise ValueError("u0 contains NaN or Inf")


def check_step(caps: Capabilities, name: str, fine: Level, u0: Tensor) -> None:
    """One fine step on u0 (the first step this rank takes) must keep shape and dtype;
    `name` is the propagator's, for the message."""
    if fine.empty or fine.last == 0:   # no point, or point 0 alone: this rank takes no step
        return
    out = caps.step(u0, fine.step(max(fine.first - 1, 0)))
    if not isinstance(out, Tensor) or out.shape != u0.shape or out.dtype != u0.dtype:
        got = (f"shape {tuple(out.shape)}, dtype {out.dtype}" if isinstance(out, Tensor)
               else type(out).__name__)
        raise TypeError(f"{name}.step returned {got} for a state of "
                        f"shape {tuple(u0.shape)}, dtype {u0.dtype}; it must keep both")
