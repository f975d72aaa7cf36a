"""Dahlquist's test equation u' = lambda u, the model problem of MGRIT theory."""

from __future__ import annotations

import math
from numbers import Complex

import torch
from torch import Tensor

from ..core.propagator import Step, StepBatch

METHODS = ("backward_euler", "forward_euler")


class Dahlquist:
    """u' = lam * u with backward or forward Euler; lam real or complex.

    A complex lam needs a complex state. The amplification factor of one step
    of length dt is `amplification(dt)`.
    """

    def __init__(self, lam: complex = -1.0, method: str = "backward_euler") -> None:
        if not isinstance(lam, Complex) or not math.isfinite(abs(lam)):
            raise TypeError(f"lam must be a finite real or complex number, got {lam!r}")
        if method not in METHODS:
            raise ValueError(f"method={method!r} is not valid; choose one of "
                             f"{', '.join(map(repr, METHODS))}")
        self.lam = lam if isinstance(lam, complex) and lam.imag != 0 else float(lam.real)
        self.method = method

    def amplification(self, dt: float) -> complex | float:
        z = dt * self.lam
        return 1.0 / (1.0 - z) if self.method == "backward_euler" else 1.0 + z

    def _apply(self, u: Tensor, dt: float) -> Tensor:
        factor = self.amplification(dt)
        if not isinstance(factor, complex):
            return u * factor
        if not u.is_complex():
            raise TypeError(f"a complex lam ({self.lam}) needs a complex state, got {u.dtype}")
        # Complex product as separate real operations: every entry is rounded the same way
        # whatever its position in a batch, so batched, looped and distributed runs agree.
        re, im = u.real, u.imag
        return torch.complex(re * factor.real - im * factor.imag,
                             re * factor.imag + im * factor.real)

    def step(self, u: Tensor, s: Step) -> Tensor:
        return self._apply(u, s.dt)

    def step_batch(self, states: Tensor, steps: StepBatch) -> Tensor:
        return self._apply(states, steps.dt)

    def step_into(self, u: Tensor, s: Step, out: Tensor, g: Tensor | None) -> None:
        """out = g + Phi(u) (g None: Phi(u)) without a temporary and a copy: the sequential
        march of the coarsest level takes one step at a time, where each call costs more
        than the arithmetic. The product is rounded before the sum, as `step` and the
        executors' `g + step(u)` round it, so every path gives the same bits (a fused
        multiply-add would not, and distributed runs would drift from serial ones)."""
        factor = self.amplification(s.dt)
        if isinstance(factor, complex):
            value = self._apply(u, s.dt)
            out.copy_(value if g is None else g + value)
            return
        torch.mul(u, factor, out=out)
        if g is not None:
            out.add_(g)
