"""Dahlquist's test equation u' = lambda u, the model problem of MGRIT theory."""

from __future__ import annotations

import math
from numbers import Complex
from typing import Callable, Hashable

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

    def program_key(self, level: int, parallel: int) -> Hashable | None:
        """Only the coarse levels' marches (phases of one step after another,
        `step_program`) are compiled: a batched phase is already one tensor operation per
        sub-step, and a march of level 0 is either a rank's few leading F-points or the one
        sweep of a one-level solve, which building a program (a Step and views per point)
        would cost more than it saves."""
        return "march" if parallel == 1 and level > 0 else None

    def step_program(self, steps: list[Step], rows: list[tuple[Tensor, Tensor, Tensor | None]],
                     parallel: int) -> Callable[[], None] | None:
        """A march of a real float64 scalar on the CPU (the coarsest level's sweep) as one
        call: the recurrence runs on Python floats, whose products and sums round exactly
        as `step_into`'s float64 tensor operations do (each once, no fused multiply-add),
        between one read of the rows and one write. Step by step each step costs a few
        tensor calls, more than the arithmetic. None (the phase runs step by step) for any
        other march: the steps must chain (each reads the row the one before wrote) through
        evenly spaced rows of one storage, with g on every step or on none."""
        if parallel != 1 or not steps:
            return None
        factors = [self.amplification(s.dt) for s in steps]
        first = rows[0][0]
        if (any(isinstance(a, complex) for a in factors) or first.dtype != torch.float64
                or first.device.type != "cpu" or first.numel() != 1):
            return None
        states = _chain(first, [out for _, out, _ in rows])
        gs = [g for _, _, g in rows]
        if states is None or any(rows[k + 1][0].data_ptr() != rows[k][1].data_ptr()
                                 for k in range(len(rows) - 1)):
            return None
        if all(g is None for g in gs):
            forcing = None
        else:
            forcing = None if any(g is None for g in gs) else _chain(None, gs)
            if forcing is None:
                return None
        values = states[1:]

        def march() -> None:
            x = states[0].item()
            out = []
            if forcing is None:
                for a in factors:
                    x = x * a
                    out.append(x)
            else:
                for a, g in zip(factors, forcing.tolist()):
                    x = x * a + g
                    out.append(x)
            values.copy_(torch.tensor(out, dtype=torch.float64))

        return march


def _chain(before: Tensor | None, rows: list[Tensor]) -> Tensor | None:
    """One strided 1-D view of `before` (if given) and `rows`, one-element tensors at evenly
    spaced places of one storage in that order; None where they are not."""
    items = ([before] if before is not None else []) + rows
    storage = items[0].untyped_storage().data_ptr()
    offsets = [t.storage_offset() for t in items]
    stride = offsets[1] - offsets[0] if len(items) > 1 else 1
    if (stride <= 0 or any(t.numel() != 1 or t.untyped_storage().data_ptr() != storage
                           for t in items)
            or offsets != list(range(offsets[0], offsets[0] + stride * len(items), stride))):
        return None
    return items[0].as_strided((len(items),), (stride,), offsets[0])
