"""A dense residual-network step u + dt * act(W_n u + b_n), one weight set per fine step."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..core.propagator import Step, StepBatch


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

    def _apply(self, states: Tensor, layers: Tensor, dt: float) -> Tensor:
        """states[i] + dt*act(W[layers[i]] states[i] + b[layers[i]]), one batched product.

        Single steps use it too (a batch of one), so every entry is computed the same way
        whatever batch it is in: looped, batched and distributed runs agree to the bit.
        """
        w, b = self.weights[layers], self.biases[layers]
        flat = states.reshape(len(layers), -1, states.shape[-1])
        z = torch.baddbmm(b[:, None, :], flat, w.transpose(1, 2))
        return states + dt * self.activation(z).reshape(states.shape)

    def step(self, u: Tensor, s: Step) -> Tensor:
        return self._apply(u[None], torch.tensor([s.fine_index]), s.dt)[0]

    def step_batch(self, states: Tensor, steps: StepBatch) -> Tensor:
        return self._apply(states, steps.fine_index, steps.dt)


class ModuleResNet:
    """u + dt * f_n(u) with f_n any module: the residual steps of a trained network, for
    studying how MGRIT converges on its layers. A coarse step uses the layer where it starts."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.layers = layers

    @torch.no_grad()
    def step(self, u: Tensor, s: Step) -> Tensor:
        return u + s.dt * self.layers[s.fine_index](u)
