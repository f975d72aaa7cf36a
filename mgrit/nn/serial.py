"""The plain network that a `LayerParallel` computes, for serial training and export."""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn


class ResidualStep(nn.Module):
    """u -> u + h * f(u): one layer of the plain (serial) network."""

    def __init__(self, f: nn.Module, h: float) -> None:
        super().__init__()
        self.f = f
        self.h = h

    def forward(self, u: Tensor) -> Tensor:
        return u + self.h * self.f(u)


def serial_resnet(step: Callable[[], nn.Module], num_steps: int, t_final: float = 1.0,
                  opening: nn.Module | None = None, closing: nn.Module | None = None
                  ) -> nn.Sequential:
    """The plain network that `LayerParallel` with the same arguments computes: opening,
    num_steps residual steps with h = t_final/num_steps, closing. The factory is called in
    the same order, so under the same seed both start from the same weights."""
    h = t_final / num_steps
    steps = [ResidualStep(step(), h) for _ in range(num_steps)]
    return nn.Sequential(opening or nn.Identity(), *steps, closing or nn.Identity())
