"""The training loop, written once: a training step, an epoch of them, an evaluation.
`mgrit train`, the benchmarks, the scaling study and the examples all train through it."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from .data import batches

LossFn = Callable[[Tensor, Tensor], Tensor]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
               x: Tensor, y: Tensor, after_forward: Callable[[], None] | None = None
               ) -> tuple[Tensor, Tensor]:
    """One optimizer step on the batch (x, y): zero the gradients, forward pass and loss,
    backward pass, update. `after_forward` is called once the loss is there, before the
    backward pass (a tracer marks the end of the forward pass there). Returns the loss and
    the model's output, both detached."""
    optimizer.zero_grad()
    out = model(x)
    loss = loss_fn(out, y)
    if after_forward is not None:
        after_forward()
    loss.backward()
    optimizer.step()
    return loss.detach(), out.detach()


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor,
                batch_size: int, generator: torch.Generator, loss_fn: LossFn) -> float:
    """One pass over (x, y) in a shuffled order; returns the mean training loss."""
    model.train()
    losses = [float(train_step(model, optimizer, loss_fn, xb, yb)[0])
              for xb, yb in batches(x, y, batch_size, generator)]
    return sum(losses) / max(len(losses), 1)


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
