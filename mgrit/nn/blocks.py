"""Building blocks of residual networks: the step factories of the reference networks and a
description of a whole network from which both its layer-parallel and its serial form are
built with the same initial weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from .layer_parallel import LayerParallel
from .serial import serial_resnet


def conv_step(channels: int) -> Callable[[], nn.Module]:
    """f(u) = ReLU(conv3x3(ReLU(conv3x3(u)))), channels -> channels, padding 1."""
    def factory() -> nn.Module:
        return nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU())
    return factory


def dense_step(width: int, activation: type[nn.Module] = nn.Tanh) -> Callable[[], nn.Module]:
    """f(u) = act(W u + b), width -> width."""
    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(width, width), activation())
    return factory


@dataclass
class ResNetSpec:
    """A residual network: opening, `num_steps` residual steps made by the factory `step`
    on [0, t_final], closing; what `LayerParallel` and `serial_resnet` take."""

    opening: nn.Module | None
    step: Callable[[], nn.Module]
    closing: nn.Module | None
    num_steps: int
    t_final: float = 1.0

    def layer_parallel(self, **options: Any) -> LayerParallel:
        """The layer-parallel network (`options`: LayerParallel's forward, backward, comm,
        data_comm, inference)."""
        return LayerParallel(self.step, self.num_steps, self.t_final, opening=self.opening,
                             closing=self.closing, **options)

    def serial(self) -> nn.Sequential:
        """The plain network (`serial_resnet`)."""
        return serial_resnet(self.step, self.num_steps, self.t_final, self.opening,
                             self.closing)
