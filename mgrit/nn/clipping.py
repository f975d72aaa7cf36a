"""Gradient clipping of a layer-parallel network by the norm of the whole network's gradient.

`torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` sees only the rank's own layers:
every rank would clip by its own factor, the replicated opening and closing would drift
apart across ranks, and the result would not be the serial network's. Here the norm is
taken over every layer of every rank once, the replicated modules counted once, and every
rank scales by the same factor."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..comm import Comm


def _norm_order(norm_type: float | str) -> float:
    """The norm's order as a float (inf for "inf"), or a ValueError naming allowed values."""
    if isinstance(norm_type, str) and norm_type.lower() == "inf":
        return math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not (
            norm_type > 0):
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    return float(norm_type)


def _grads(params: list[nn.Parameter]) -> list[Tensor]:
    return [p.grad for p in params if p.grad is not None]


def global_grad_norm(layer_params: list[nn.Parameter], replicated: list[nn.Parameter],
                     comm: Comm, norm_type: float) -> float:
    """The norm of the gradient of the whole network: the layers' gradients, split over the
    ranks of `comm`, and the replicated modules' gradients (the same on every rank), counted
    once. One collective; every rank gets the same value (rank 0 contributes the
    replicated part, so no rank's rounding differs)."""
    layers = [g.detach() for g in _grads(layer_params)]
    shared = [g.detach() for g in _grads(replicated)] if comm.rank == 0 else []
    if math.isinf(norm_type):
        # the maximum over ranks, by a sum of one slot per rank (the comm sums only)
        slots = torch.zeros(comm.size, dtype=torch.float64)
        mine = [torch.linalg.vector_norm(g, math.inf, dtype=torch.float64).cpu()
                for g in layers + shared]
        slots[comm.rank] = torch.stack(mine).max() if mine else 0.0
        comm.allreduce_sum_(slots)
        return float(slots.max())
    # sums of |g|^p in float64: the partial sums of ranks and modules add up without the
    # rounding of the gradients' own dtype
    total = torch.zeros(1, dtype=torch.float64)
    for g in layers + shared:
        total += torch.linalg.vector_norm(g, norm_type, dtype=torch.float64).cpu() ** norm_type
    comm.allreduce_sum_(total)
    return float(total[0]) ** (1.0 / norm_type)


def clip_grad_norm_(layer_params: list[nn.Parameter], replicated: list[nn.Parameter],
                    comm: Comm, max_norm: float, norm_type: float | str = 2.0,
                    error_if_nonfinite: bool = False) -> Tensor:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)), norm the whole network's
    (`global_grad_norm`), as `torch.nn.utils.clip_grad_norm_` does for one process; returns
    the norm (the same on every rank). The arguments are checked before any communication."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not (
            max_norm >= 0):
        raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
    order = _norm_order(norm_type)
    grads = _grads(layer_params) + _grads(replicated)
    dtype = grads[0].dtype if grads else torch.get_default_dtype()
    norm = global_grad_norm(layer_params, replicated, comm, order)
    if error_if_nonfinite and not math.isfinite(norm):
        raise RuntimeError(f"the total norm of order {order} of the gradients is {norm}, so "
                           "they cannot be clipped; set error_if_nonfinite=False to clip "
                           "anyway (the gradients then become nan)")
    # as torch: a nan norm makes the factor nan, an infinite one makes it 0
    coef = max_norm / (norm + 1e-6)
    if not coef < 1.0 and not math.isnan(coef):
        return torch.tensor(norm, dtype=dtype)
    for g in grads:
        g.mul_(coef)
    return torch.tensor(norm, dtype=dtype)
