"""The training loop, written once: a training step, an epoch of them, an evaluation.
`mgrit train`, the benchmarks, the scaling study and the examples all train through it.

Outputs are logits over the last dimension and targets hold a class index for every row of
them: (batch, classes) against (batch,) for a classifier, (batch, tokens, vocabulary)
against (batch, tokens) for a language model, whose every position is a prediction of the
next token. Losses are means over those predictions, accuracies fractions of them."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from ..nn import Controller
from .data import batches

LossFn = Callable[[Tensor, Tensor], Tensor]


def sequence_cross_entropy(out: Tensor, y: Tensor) -> Tensor:
    """Cross entropy of logits (..., classes) against targets (...), the mean over every
    position: a language model's loss, all next-token predictions of the batch alike."""
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def correct(out: Tensor, y: Tensor) -> int:
    """How many of the predictions in `out` (logits over the last dimension) name their
    target in `y`; there are y.numel() predictions."""
    return int((out.argmax(dim=-1) == y).sum())


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
               x: Tensor, y: Tensor, after_forward: Callable[[], None] | None = None,
               control: Controller | None = None) -> tuple[Tensor, Tensor]:
    """One optimizer step on the batch (x, y): zero the gradients, forward pass and loss,
    backward pass, update. `after_forward` is called once the loss is there, before the
    backward pass (a tracer marks the end of the forward pass there). A `control`ler sees
    the step between the backward pass and the update (it may probe the same batch; the
    update uses the step's own gradient). Returns the loss and the model's output, both
    detached."""
    optimizer.zero_grad()
    out = model(x)
    loss = loss_fn(out, y)
    if after_forward is not None:
        after_forward()
    loss.backward()
    if control is not None:
        control.after_backward(lambda: loss_fn(model(x), y))
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
    """(mean loss, accuracy) over (x, y), in order, every prediction counted once: each
    example of a classifier, each position of a language model (`loss_fn` a mean over the
    predictions of a batch)."""
    model.eval()
    total_loss, right = 0.0, 0
    for start in range(0, len(x), batch_size):
        out = model(x[start: start + batch_size])
        yb = y[start: start + batch_size]
        total_loss += float(loss_fn(out, yb)) * yb.numel()
        right += correct(out, yb)
    return total_loss / y.numel(), right / y.numel()
