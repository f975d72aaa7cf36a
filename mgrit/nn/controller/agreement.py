"""How close one gradient is to another: cosine similarity and relative error per parameter
group and overall, from sums reduced over the layer-parallel ranks so that every rank gets
the same numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..layer_parallel import LayerParallel

GROUPS = ("opening", "layers", "closing")


def _group(name: str) -> str:
    """The parameter group of a `LayerParallel` parameter name."""
    head = name.split(".", 1)[0]
    return head if head in GROUPS else "layers"


def gradient_agreement(model: LayerParallel, gradients: Sequence[Tensor | None],
                       reference: Sequence[Tensor | None]) -> dict[str, dict[str, float]]:
    """Cosine similarity and relative error |g - r| / |r| of `gradients` against
    `reference` (one entry per trainable parameter of `model`, in `parameters()` order; None
    counts as zero), per group ("opening", "layers", "closing") and "overall".

    Each rank holds its own layers' gradients and the same opening and closing ones, so the
    sums of products are reduced over the layer-parallel group once, with the replicated
    groups counted on one rank only: every rank gets the same numbers. Collective."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    if len(names) != len(gradients) or len(names) != len(reference):
        raise ValueError(f"{len(gradients)} gradients and {len(reference)} references for "
                         f"{len(names)} trainable parameters")
    # per group: <g, r>, |g|^2, |r|^2, |g - r|^2 (the difference directly: accurate for
    # small errors, where the expanded form would cancel)
    sums = torch.zeros(len(GROUPS), 4, dtype=torch.float64)
    for name, g, r in zip(names, gradients, reference):
        row = GROUPS.index(_group(name))
        if row != GROUPS.index("layers") and model.comm.rank != 0:
            continue
        if g is None and r is None:
            continue
        g = torch.zeros_like(r) if g is None else g
        r = torch.zeros_like(g) if r is None else r
        g64, r64 = g.detach().double().reshape(-1), r.detach().double().reshape(-1)
        d = g64 - r64
        sums[row] += torch.stack([g64 @ r64, g64 @ g64, r64 @ r64, d @ d]).cpu()
    if model.comm.size > 1:
        model.comm.allreduce_sum_(sums)
    out = {group: _agreement(*sums[i].tolist()) for i, group in enumerate(GROUPS)}
    out["overall"] = _agreement(*sums.sum(dim=0).tolist())
    return out


def _agreement(dot: float, gg: float, rr: float, dd: float) -> dict[str, float]:
    cosine = dot / math.sqrt(gg * rr) if gg > 0 and rr > 0 else (1.0 if gg == rr else 0.0)
    error = math.sqrt(dd / rr) if rr > 0 else (0.0 if dd == 0 else math.inf)
    return {"cosine": cosine, "relative_error": error}


def mean_over_ranks(model: LayerParallel, values: list[float]) -> list[float]:
    """The mean of `values` over the layer-parallel ranks and the data-parallel replicas:
    what every rank then decides from alike. Collective."""
    buf = torch.tensor(values, dtype=torch.float64)
    count = 1
    for comm in (model.comm, model.data_comm):
        if comm is not None and comm.size > 1:
            comm.allreduce_sum_(buf)
            count *= comm.size
    return (buf / count).tolist()
