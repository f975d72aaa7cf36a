"""Parameter gradients of a layer-parallel network: dL/dtheta of a rank's layers, assembled
from what the adjoint solve recorded, and their mean over data-parallel replicas."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from ..comm import Comm
from .stack import LayerStack

# up to this many parameter values on a rank, the recorded gradients are gathered in one
# scatter per tensor; above, batch by batch (fewer passes over large data)
_GATHERED_GRADIENTS = 1 << 16


def layer_gradients(layers: LayerStack,
                    recorded: list[tuple[list[int], dict[str, Tensor], float]]
                    ) -> dict[str, Tensor]:
    """dL/dtheta of the owned layers (parameter name -> stacked gradient), as the adjoint's
    final fine sweep recorded them (its one VJP per layer, at final values, gives both w_n
    and dL/dtheta_n); where a layer was recorded twice, the later entry counts."""
    lo, count = layers.first, layers.count
    rows = [layer - lo for batch, _, _ in recorded for layer in batch]
    reached = set(rows)
    if not reached.issuperset(range(count)):
        missing = [lo + r for r in sorted(set(range(count)) - reached)]
        raise RuntimeError(f"the adjoint's final fine sweep did not reach layers {missing}")
    params = {name: layers.params[name.replace(".", "__")] for name in layers.names}
    dts = {dt for _, _, dt in recorded}
    values = count * sum(p[0].numel() for p in params.values()) if count else 0
    if len(rows) == count and len(dts) == 1 and values <= _GATHERED_GRADIENTS:
        # every layer once, one step size, little data (W2 on many ranks: a few batches
        # of a few layers): one scatter per tensor instead of a few calls per batch
        dt = dts.pop()
        index = torch.tensor(rows)
        grads = {}
        for name, param in params.items():
            parts = [cotangents[name] for _, cotangents, _ in recorded]
            grad = torch.empty_like(param)
            grad.index_copy_(0, index.to(param.device),
                             torch.cat(parts) if len(parts) > 1 else parts[0])
            grads[name] = grad.mul_(dt)
        return grads
    # every row is written below; zeroed first only where some row is written twice
    blank = torch.empty_like if len(rows) == count else torch.zeros_like
    grads = {name: blank(param) for name, param in params.items()}
    for batch, cotangents, dt in recorded:
        first, step = batch[0] - lo, (batch[1] - batch[0] if len(batch) > 1 else 1)
        if step != 0 and batch == list(range(batch[0], batch[-1] + step, step)):
            # an arithmetic progression (every batch is): slices, not index tensors
            at: slice | Tensor = slice(min(first, batch[-1] - lo),
                                       max(first, batch[-1] - lo) + 1, abs(step))
            flip = step < 0
        else:
            at, flip = torch.tensor(batch) - lo, False
        for name in grads:
            cot = cotangents[name]
            if isinstance(at, slice):
                torch.mul(cot.flip(0) if flip else cot, dt, out=grads[name][at])
            else:
                grads[name][at.to(cot.device)] = dt * cot
    return grads


def average_gradients(parameters: Iterable[nn.Parameter], data_comm: Comm) -> None:
    """Mean of the gradients over data-parallel replicas: one allreduce of one buffer."""
    params = [p for p in parameters if p.requires_grad]
    if not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params])
    data_comm.allreduce_sum_(flat)
    flat /= data_comm.size
    offset = 0
    for p in params:
        n = p.numel()
        grad = flat[offset: offset + n].view_as(p)
        if p.grad is None:
            p.grad = grad.clone()
        else:
            p.grad.copy_(grad)
        offset += n


def context_gradients(recorded: list[tuple[list[int], dict[str, Tensor], float]],
                      context: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """dL/dc of the context tensors that require grad, summed over this rank's layers: each
    layer's cotangent (recorded under `prefix + name`, one row per layer of a batch; a layer
    recorded twice counts once, its later entry; a batch without an entry contributed
    zeros) times its step size."""
    live = [name for name, value in context.items() if value.requires_grad]
    if not live:
        return {}
    rows: dict[int, dict[str, Tensor | None]] = {}
    for batch, cotangents, dt in recorded:
        for i, layer in enumerate(batch):
            rows[layer] = {name: (cotangents[prefix + name][i] * dt
                                  if prefix + name in cotangents else None)
                           for name in live}
    out = {}
    for name in live:
        total = torch.zeros_like(context[name])
        for entry in rows.values():
            if entry[name] is not None:
                total += entry[name]
        out[name] = total
    return out
