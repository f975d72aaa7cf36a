"""Building blocks of residual networks: the step factories of the reference networks and a
description of a whole network from which both its layer-parallel and its serial form are
built with the same initial weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from .layer_parallel import LayerParallel
from .serial import serial_resnet
from .transformer import TransformerBlock


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


def transformer_step(width: int, heads: int, hidden: int | None = None, dropout: float = 0.0,
                     causal: bool = False, norm: str = "layer") -> Callable[[], nn.Module]:
    """f(u) = the residual of a pre-norm transformer block (`TransformerBlock`)."""
    def factory() -> nn.Module:
        return TransformerBlock(width, heads, hidden, dropout, causal, norm)
    return factory


class TokenEmbedding(nn.Module):
    """Opening of a language model: token ids (batch, tokens) -> states (batch, tokens,
    width), a token embedding plus a learned position embedding."""

    def __init__(self, vocab: int, width: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.randn(context, width) * 0.02)

    def forward(self, ids: Tensor) -> Tensor:
        if ids.shape[-1] > len(self.positions):
            raise ValueError(f"sequences of {ids.shape[-1]} tokens are longer than the "
                             f"context of {len(self.positions)}")
        return self.tokens(ids) + self.positions[: ids.shape[-1]]


class PatchEmbedding(nn.Module):
    """Opening of a vision transformer: images (batch, channels, H, W) -> states (batch,
    patches, width), non-overlapping `patch` x `patch` patches mapped linearly, plus a
    learned position embedding."""

    def __init__(self, channels: int, size: int, patch: int, width: int) -> None:
        super().__init__()
        if size % patch:
            raise ValueError(f"image size {size} is not a multiple of the patch size {patch}")
        self.patch = patch
        self.embed = nn.Linear(channels * patch * patch, width)
        self.positions = nn.Parameter(torch.randn((size // patch) ** 2, width) * 0.02)

    def forward(self, x: Tensor) -> Tensor:
        patches = nn.functional.unfold(x, self.patch, stride=self.patch).transpose(1, 2)
        return self.embed(patches) + self.positions


class MeanPoolHead(nn.Module):
    """Closing of a vision transformer: norm, mean over tokens, logits of `classes`."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, classes)

    def forward(self, u: Tensor) -> Tensor:
        return self.out(self.norm(u).mean(dim=1))


def gpt(vocab: int, width: int = 64, heads: int = 4, blocks: int = 32, context: int = 64,
        dropout: float = 0.1, t_final: float = 1.0) -> "ResNetSpec":
    """A GPT-style decoder-only language model: token and position embeddings, `blocks`
    causal pre-norm transformer blocks, a final norm and logits over the vocabulary for
    every position, (batch, tokens) ids -> (batch, tokens, vocab)."""
    closing = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab))
    return ResNetSpec(TokenEmbedding(vocab, width, context),
                      transformer_step(width, heads, 4 * width, dropout, causal=True),
                      closing, blocks, t_final)


def vit(channels: int = 1, size: int = 8, patch: int = 2, width: int = 32, heads: int = 4,
        blocks: int = 16, classes: int = 10, dropout: float = 0.0, t_final: float = 1.0
        ) -> "ResNetSpec":
    """A small vision transformer: patches as tokens, `blocks` pre-norm transformer blocks,
    mean-pooled logits of `classes`."""
    return ResNetSpec(PatchEmbedding(channels, size, patch, width),
                      transformer_step(width, heads, 4 * width, dropout),
                      MeanPoolHead(width, classes), blocks, t_final)


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
        data_comm, inference, seed, kernels)."""
        return LayerParallel(self.step, self.num_steps, self.t_final, opening=self.opening,
                             closing=self.closing, **options)

    def serial(self) -> nn.Sequential:
        """The plain network (`serial_resnet`); its forward takes the same context inputs."""
        return serial_resnet(self.step, self.num_steps, self.t_final, self.opening,
                             self.closing)
