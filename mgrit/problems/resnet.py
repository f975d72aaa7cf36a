"""A dense residual-network step u + dt * act(W_n u + b_n), one weight set per fine step."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..propagator import Step, StepBatch


class DenseResNet:
    """Forward Euler on u' = act(W(t) u + b(t)) with piecewise-constant W, b.

    `weights` has shape (N, d, d) and `biases` (N, d): the layer of fine step n.
    A state has shape (..., d) (e.g. (batch, d)). A coarse step starting at fine
    step n uses layer n with the coarse dt.
    """

    def __init__(self, weights: Tensor, biases: Tensor,
                 activation: Callable[[Tensor], Tensor] = torch.tanh) -> None:
        if weights.dim() != 3 or weights.shape[1] != weights.shape[2]:
            raise ValueError(f"weights must have shape (N, d, d), got {tuple(weights.shape)}")
        if biases.shape != weights.shape[:2]:
            raise ValueError(f"biases must have shape {tuple(weights.shape[:2])}, "
                             f"got {tuple(biases.shape)}")
        self.weights = weights
        self.biases = biases
        self.activation = activation

    @classmethod
    def random(cls, num_steps: int, width: int, scale: float = 1.0, seed: int = 0,
               dtype: torch.dtype = torch.float64) -> "DenseResNet":
        """Layers with N(0, scale^2/width) weights and N(0, 0.1^2) biases."""
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(num_steps, width, width, generator=gen, dtype=dtype) * scale / width ** 0.5
        b = torch.randn(num_steps, width, generator=gen, dtype=dtype) * 0.1
        return cls(w, b)

    def step(self, u: Tensor, s: Step) -> Tensor:
        w, b = self.weights[s.fine_index], self.biases[s.fine_index]
        return u + s.dt * self.activation(u @ w.T + b)

    def step_batch(self, states: Tensor, steps: StepBatch) -> Tensor:
        idx = steps.fine_index
        w, b = self.weights[idx], self.biases[idx]
        flat = states.reshape(len(steps), -1, states.shape[-1])
        z = torch.baddbmm(b[:, None, :], flat, w.transpose(1, 2))
        return states + steps.dt * self.activation(z).reshape(states.shape)
