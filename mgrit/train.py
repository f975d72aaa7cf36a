"""Training and evaluation loops shared by the benchmarks and the command line."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from .data import batches

LossFn = Callable[[Tensor, Tensor], Tensor]


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor,
                batch_size: int, generator: torch.Generator, loss_fn: LossFn,
                on_step: Callable[[int, float], None] | None = None) -> float:
    """One pass over (x, y) in a shuffled order; returns the mean training loss."""
    model.train()
    total, count = 0.0, 0
    for xb, yb in batches(x, y, batch_size, generator):
        optimizer.zero_grad()
        loss = loss_fn(model(xb), yb)
        loss.backward()
        optimizer.step()
        value = float(loss.detach())
        total += value
        count += 1
        if on_step is not None:
            on_step(count, value)
    return total / max(count, 1)


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, loss_fn: LossFn,
             batch_size: int = 512) -> tuple[float, float]:
    """(mean loss, accuracy) over (x, y), in order, every example counted once."""
    model.eval()
    total_loss, correct = 0.0, 0
    for start in range(0, len(x), batch_size):
        out = model(x[start: start + batch_size])
        yb = y[start: start + batch_size]
        total_loss += float(loss_fn(out, yb)) * len(yb)
        correct += int((out.argmax(dim=1) == yb).sum())
    return total_loss / len(x), correct / len(x)
