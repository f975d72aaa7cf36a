"""The solver settings of layer-parallel training unless told otherwise: written here once,
read by `LayerParallel`, by the `mgrit train` settings and by the benchmarks."""

from __future__ import annotations

from typing import Any

from ..core.config import Config

# MGRIT cycles per training step: the forward state need not be exact for a useful gradient,
# and one adjoint cycle from the forward pass's states is enough in practice (measured in
# docs/results.md); levels=1 gives exact serial gradients instead
CYCLES = {"forward": 2, "backward": 1}


def training_options(direction: str, levels: int = 3, coarsening: int = 4) -> dict[str, Any]:
    """Keyword arguments of the `Config` of a training step's forward or backward solve:
    `levels` levels coarsened by `coarsening`, F-relaxation on the fine level (its final
    sweep gives the states the other pass needs) and FCF below, a fixed number of cycles
    (tol = 0: no residual reduction between cycles), coarsening down to one step."""
    if direction not in CYCLES:
        raise ValueError(f"direction={direction!r} is not valid; choose one of "
                         f"{', '.join(map(repr, CYCLES))}")
    relax: str | tuple[str, ...] = ("F",) + ("FCF",) * (levels - 2) if levels > 1 else "F"
    return dict(levels=levels, coarsening=coarsening, relax=relax, max_iter=CYCLES[direction],
                tol=0.0, min_coarse=1)


def training_config(direction: str, levels: int = 3, coarsening: int = 4) -> Config:
    """The `Config` of `training_options`."""
    return Config(**training_options(direction, levels, coarsening))
