"""Probing: the gradient of the training step just taken computed again with other solver
options (by default exact stepping, `levels=1`: one sequential sweep each way), without
disturbing the step: the parameters' gradients are the training step's again afterwards."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ...core.config import Config
from ..layer_parallel import LayerParallel
from .agreement import gradient_agreement

# options of an exact pass: sequential stepping, one sweep (levels=1 ignores the rest)
EXACT = Config(levels=1, max_iter=1, tol=0.0)


@dataclass
class ProbeResult:
    """What one probe measured: the agreement of the training step's gradient with the
    probe's (per group and overall, `gradient_agreement`), the probe's loss, the seconds
    its two solves took on this rank (`stats` "seconds": what the solver options cost) and
    the seconds the whole probe took."""

    agreement: dict[str, dict[str, float]]
    loss: float
    solve_seconds: float
    seconds: float
    gradients: list[Tensor | None] = field(default_factory=list, repr=False)

    @property
    def error(self) -> float:
        """The overall relative error of the training gradient against the probe's."""
        return self.agreement["overall"]["relative_error"]

    @property
    def cosine(self) -> float:
        return self.agreement["overall"]["cosine"]


def probe_solves(model: LayerParallel, closure: Callable[[], Tensor], forward: Config,
                 backward: Config) -> tuple[list[Tensor | None], float, dict[str, Any]]:
    """(gradients, loss, the passes' `stats`) of the training step just taken, computed
    again with the solver options `forward` and `backward`; the parameters' own gradients
    are as they were afterwards. See `probe`."""
    params = [p for p in model.parameters() if p.requires_grad]
    trained = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        with model.probing(forward, backward) as stats:
            loss = closure()
            loss.backward()
        gradients = [p.grad for p in params]
    finally:
        for p, g in zip(params, trained):
            p.grad = g
    return gradients, float(loss.detach()), stats


def probe_gradients(model: LayerParallel, closure: Callable[[], Tensor], forward: Config,
                    backward: Config) -> tuple[list[Tensor | None], float, float]:
    """(gradients, loss, seconds of its two solves on this rank) of the training step just
    taken, computed again with the solver options `forward` and `backward`; the parameters'
    own gradients are as they were afterwards. See `probe`."""
    gradients, loss, stats = probe_solves(model, closure, forward, backward)
    seconds = sum(stats[kind]["seconds"] for kind in ("forward", "backward") if kind in stats)
    return gradients, loss, seconds


def probe(model: LayerParallel, closure: Callable[[], Tensor], forward: Config = EXACT,
          backward: Config = EXACT) -> ProbeResult:
    """The gradient of the training step just taken, computed again with the solver options
    `forward` and `backward` (by default exact stepping), and compared with the training
    gradient that the parameters hold. `closure()` computes the step's loss again: the same
    batch through `model` (`loss_fn(model(x), y)`). Call it after the step's backward pass
    and before the optimizer step: the parameters' gradients are the training step's again
    when it returns (the optimizer steps with the gradient training produced), the random
    draws are the step's own, and training's solvers and warm-start states are untouched
    (`LayerParallel.probing`). Collective."""
    start = time.perf_counter()
    trained = [p.grad for p in model.parameters() if p.requires_grad]
    gradients, loss, solve_seconds = probe_gradients(model, closure, forward, backward)
    agreement = gradient_agreement(model, trained, gradients)
    return ProbeResult(agreement, loss, solve_seconds, time.perf_counter() - start, gradients)
