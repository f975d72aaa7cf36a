"""What `LayerParallel` checks before it solves: the solver options of its passes (their
level grids must suit training and the number of layers) and the inputs of a forward
pass (agreed between ranks, then tried on the step module once per shape)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..comm.base import innermost
from ..core.config import Config
from ..core.grid import LevelGrid, build_hierarchy, layer_ranges
from .engine import randomness as draws
from .engine.stack import LayerStack

if TYPE_CHECKING:
    from .layer_parallel import LayerParallel


def level_grids(kind: str, cfg: Any, num_steps: int) -> list[LevelGrid]:
    """The level grids of a pass's options, which must suit training and the layers."""
    if not isinstance(cfg, Config):
        raise TypeError(f"{kind} must be a mgrit.Config, got {type(cfg).__name__}")
    if isinstance(cfg.initial_guess, Tensor):
        raise ValueError(f"{kind}: a tensor initial guess makes no sense for training; "
                         "use 'zero', 'nested' or 'warm'")
    grids = build_hierarchy(num_steps, cfg.coarsening_list(), cfg.levels, cfg.min_coarse)
    if len(grids) < cfg.levels:
        sizes = [g.num_steps for g in grids]
        raise ValueError(
            f"num_steps={num_steps} is too small for the {kind} solver's levels="
            f"{cfg.levels} with coarsening {cfg.coarsening} and min_coarse="
            f"{cfg.min_coarse}: the levels would have {sizes} steps; use fewer levels, "
            "a smaller coarsening or more layers")
    return grids


def partition(blocks: list[tuple[int, int]], num_steps: int) -> list[tuple[int, int]]:
    """The (first, last) layer of each rank, whose fine-level `blocks` the forward pass's
    grids give (`level0_blocks`); refused where a rank would hold none (the adjoint solve
    would have no state to run on there)."""
    ranks = len(blocks)
    ranges = layer_ranges(blocks, num_steps)
    if any(last < first for first, last in ranges):
        raise ValueError(f"num_steps={num_steps} layers cannot be shared by {ranks} ranks: "
                         f"every rank needs at least one layer; use at most {num_steps} "
                         f"rank(s) or at least {ranks} layers")
    return ranges


def draws_from_generator(layers: LayerStack, u0: Tensor) -> bool:
    """Whether the step module draws from torch's generator in training mode (beyond the
    keyed `Dropout`s): it then fails vmap's randomness check. Such modules run layer by
    layer, each seeded with its key (`mgrit.nn.engine.module_strategy`)."""
    from torch.func import vmap

    placeholder = layers.placeholder()
    try:
        with torch.no_grad(), draws.keyed(0):
            vmap(lambda u: layers.f(placeholder, u), randomness="error")(u0.detach()[None])
    except RuntimeError as err:
        return "random" in str(err)
    return False


def check_backward_thread(model: LayerParallel, device: torch.device) -> None:
    """On CUDA autograd runs a backward pass on a device thread of its own, and with it the
    adjoint solve's messages and the replicas' gradient averaging: an MPI started to take
    calls from the main thread alone would be called from elsewhere, which MPI leaves
    undefined. Refused before the forward pass that would need it (the same verdict on
    every rank, whose MPI was started alike)."""
    if device.type != "cuda":
        return
    for comm in (model.comm, model.data_comm):
        if comm is None or comm.size == 1:
            continue
        level = getattr(innermost(comm), "one_thread_only", None)
        if level is not None:
            raise RuntimeError(
                f"MPI was started with {level}, but on CUDA autograd runs the backward "
                "pass (the adjoint solve and its messages) on a thread of its own; start "
                "MPI with MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE (mpi4py asks for "
                "MULTIPLE unless mpi4py.rc.thread_level is set lower before "
                "`from mpi4py import MPI`)")


def check_inputs(model: LayerParallel, u0: Tensor, context: dict[str, Tensor]) -> None:
    """One agreement between ranks on what a forward pass was given, then local checks
    (every rank reaches the same verdict, so all raise or none does); the step module is
    tried once per input shape, dtype, context and mode (`model._checked_shapes`)."""
    described = tuple((name, tuple(v.shape), str(v.dtype), v.requires_grad)
                      if isinstance(v, Tensor) else (name, type(v).__name__)
                      for name, v in sorted(context.items()))
    # whether u0 requires grad decides whether the backward pass broadcasts dL/du0 (a
    # collective): ranks that differed there would wait for each other for ever
    model.comm.agree("input batch shape and dtype, whether it requires grad, and "
                    "context inputs",
                    (tuple(u0.shape), str(u0.dtype), u0.requires_grad, described))
    for name, value in context.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"context input {name!r} must be a tensor, got "
                            f"{type(value).__name__}: pass other settings to the step "
                            "module's constructor")
        if value.device != u0.device:
            raise ValueError(f"context input {name!r} is on {value.device}, the state on "
                             f"{u0.device}")
    key = (tuple(u0.shape), u0.dtype, described, model.training)
    if key not in model._checked_shapes:
        layers = model.layers
        with torch.no_grad():
            try:
                out = layers.f(layers.placeholder(), u0.detach())
            except TypeError as err:
                if not context:
                    raise
                raise ValueError(f"the step module does not take the context inputs "
                                 f"{sorted(context)} as keyword arguments of its forward "
                                 f"({err})") from None
        if not isinstance(out, Tensor) or out.shape != u0.shape or out.dtype != u0.dtype:
            got = (f"shape {tuple(out.shape)}, dtype {out.dtype}" if isinstance(out, Tensor)
                   else type(out).__name__)
            raise ValueError(f"the step module maps a state of shape {tuple(u0.shape)}, "
                             f"dtype {u0.dtype} to {got}; a residual step needs the same "
                             "shape and dtype")
        if model.training and not layers.batched and not layers.torch_random:
            layers.torch_random = draws_from_generator(layers, u0)
        model._checked_shapes.add(key)
