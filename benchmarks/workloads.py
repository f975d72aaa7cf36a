"""The networks of the reference workloads (docs/design.md, "Reference workloads")."""

from __future__ import annotations

from torch import Tensor, nn

from mgrit.nn.blocks import ResNetSpec, conv_step, dense_step


class RepeatChannels(nn.Module):
    """Opening of W1: repeat a one-channel image to `channels` channels (no parameters)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.channels = channels

    def forward(self, x: Tensor) -> Tensor:
        return x.repeat(1, self.channels, 1, 1)


def w1(channels: int = 3, num_steps: int = 32) -> ResNetSpec:
    """W1: MNIST-shaped conv ResNet; log-probabilities of 10 classes for 1x28x28 images."""
    closing = nn.Sequential(nn.Flatten(), nn.Linear(channels * 28 * 28, 32), nn.ReLU(),
                            nn.Linear(32, 10), nn.LogSoftmax(dim=1))
    return ResNetSpec(RepeatChannels(channels), conv_step(channels), closing, num_steps)


def w2(width: int = 32, num_steps: int = 1024, classes: int = 10) -> ResNetSpec:
    """W2: deep and narrow dense ResNet, u + h*tanh(W u + b); logits of `classes`."""
    return ResNetSpec(None, dense_step(width), nn.Linear(width, classes), num_steps)


def digits_dense(width: int = 32, num_steps: int = 32) -> ResNetSpec:
    """W3's network: 8x8 digit images (64 features) -> width, dense tanh steps, 10 logits."""
    opening = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.Tanh())
    return ResNetSpec(opening, dense_step(width), nn.Linear(width, 10), num_steps)
