"""The plain network that a `LayerParallel` computes, for serial training and export."""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor, nn

from .engine import randomness as draws


class ResidualStep(nn.Module):
    """u -> u + h * f(u, **context): layer `index` of the plain (serial) network.

    Inside `mgrit.nn.draws(seed, step)` its stochastic layers draw with
    `layer_key(seed, step, index)`, as layer `index` of a `LayerParallel` does in its
    training step `step`; outside, with torch's generator."""

    def __init__(self, f: nn.Module, h: float, index: int = 0) -> None:
        super().__init__()
        self.f = f
        self.h = h
        self.index = index

    def forward(self, u: Tensor, **context: Any) -> Tensor:
        key = draws.scheduled_key(self.index) if self.training else None
        if key is None:
            return u + self.h * self.f(u, **context)
        with draws.keyed(key), draws.seeded(key, u.device):
            return u + self.h * self.f(u, **context)


class ResidualNetwork(nn.Sequential):
    """opening, residual steps, closing; `forward(x, **context)` passes the context (masks,
    positions, conditioning) to every residual step, as `LayerParallel` does."""

    def forward(self, x: Tensor, **context: Any) -> Tensor:
        modules = list(self)
        u = modules[0](x)
        for layer in modules[1:-1]:
            u = layer(u, **context)
        return modules[-1](u)


def serial_resnet(step: Callable[[], nn.Module], num_steps: int, t_final: float = 1.0,
                  opening: nn.Module | None = None, closing: nn.Module | None = None
                  ) -> ResidualNetwork:
    """The plain network that `LayerParallel` with the same arguments computes: opening,
    num_steps residual steps with h = t_final/num_steps, closing. The factory is called in
    the same order, so under the same seed both start from the same weights; nn.Dropout
    inside steps becomes `mgrit.nn.Dropout` (torch's draws outside `mgrit.nn.draws`)."""
    h = t_final / num_steps
    steps = [ResidualStep(draws.replace_dropout(step()), h, n) for n in range(num_steps)]
    return ResidualNetwork(opening or nn.Identity(), *steps, closing or nn.Identity())
