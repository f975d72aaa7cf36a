"""The networks of the reference workloads (DESIGN.md section 6) and their building blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor, nn


class RepeatChannels(nn.Module):
    """Opening of W1: repeat a one-channel image to `channels` channels (no parameters)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.channels = channels

    def forward(self, x: Tensor) -> Tensor:
        return x.repeat(1, self.channels, 1, 1)


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
class Network:
    """What LayerParallel and serial_resnet need: opening, residual step, closing, N, T."""

    opening: nn.Module | None
    step: Callable[[], nn.Module]
    closing: nn.Module | None
    num_steps: int
    t_final: float = 1.0


def w1(channels: int = 3, num_steps: int = 32) -> Network:
    """W1: MNIST-shaped conv ResNet; log-probabilities of 10 classes for 1x28x28 images."""
    closing = nn.Sequential(nn.Flatten(), nn.Linear(channels * 28 * 28, 32), nn.ReLU(),
                            nn.Linear(32, 10), nn.LogSoftmax(dim=1))
    return Network(RepeatChannels(channels), conv_step(channels), closing, num_steps)


def w2(width: int = 32, num_steps: int = 1024, classes: int = 10) -> Network:
    """W2: deep and narrow dense ResNet, u + h*tanh(W u + b); logits of `classes`."""
    return Network(None, dense_step(width), nn.Linear(width, classes), num_steps)


def digits_dense(width: int = 32, num_steps: int = 32) -> Network:
    """W3's network: 8x8 digit images (64 features) -> width, dense tanh steps, 10 logits."""
    opening = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.Tanh())
    return Network(opening, dense_step(width), nn.Linear(width, 10), num_steps)
