"""Getting a layer-parallel network out: one checkpoint file per rank (its layers, opening,
closing, optimizer state and warm-start states, refused by a different network or
partition) and the export to the equivalent plain serial network."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .ghosts import placement
from .passes import Passes
from .serial import ResidualStep

if TYPE_CHECKING:
    from .layer_parallel import LayerParallel

# the version of the checkpoint files' layout (their keys); files of another are refused
CHECKPOINT_FORMAT = 1


def checkpoint_path(model: LayerParallel, directory: str | os.PathLike) -> Path:
    """This rank's file in `directory`: one per layer-parallel rank and data replica."""
    data = f"-data{model.data_comm.rank:05d}" if model.data_comm is not None else ""
    return Path(directory) / f"rank{model.comm.rank:05d}-of-{model.comm.size:05d}{data}.pt"


def _layout(model: LayerParallel) -> dict[str, Any]:
    """What a checkpoint must match: the network's shape and this rank's part of it."""
    layers = model.layers
    return {"num_steps": model.num_steps, "t_final": model.t_final, "ranks": model.comm.size,
            "rank": model.comm.rank, "layers": model.layer_range,
            "parameters": [(n, tuple(p.shape[1:])) for n, p in
                           zip(layers.names, layers.params.values())]}


def save(model: LayerParallel, passes: Passes, directory: str | os.PathLike,
         optimizer: torch.optim.Optimizer | None, extra: dict[str, Any]) -> Path:
    """Write this rank's checkpoint (see `LayerParallel.save_checkpoint`)."""
    path = checkpoint_path(model, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": CHECKPOINT_FORMAT, "layout": _layout(model),
             "model": model.state_dict(),
             "optimizer": optimizer.state_dict() if optimizer is not None else None,
             "warm": passes.warm_states(), "extra": extra}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load(model: LayerParallel, passes: Passes, directory: str | os.PathLike,
         optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Restore this rank's checkpoint; returns its extra entries (see
    `LayerParallel.load_checkpoint`)."""
    path = checkpoint_path(model, directory)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint for this rank at {path}")
    _, device = placement(model.layers)
    state = torch.load(path, map_location=device, weights_only=False)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a mgrit checkpoint of format {CHECKPOINT_FORMAT}")
    mine = _layout(model)
    for key, value in state["layout"].items():
        if mine.get(key) != value:
            raise ValueError(f"{path} holds a different network or partition: {key} is "
                             f"{value!r} there and {mine.get(key)!r} here")
    model.load_state_dict(state["model"])
    if optimizer is not None:
        if state["optimizer"] is None:
            raise ValueError(f"{path} has no optimizer state")
        optimizer.load_state_dict(state["optimizer"])
    passes.set_warm_states(state["warm"], device)
    return state["extra"]


def to_serial(model: LayerParallel) -> nn.Sequential | None:
    """The equivalent plain network on rank 0 (see `LayerParallel.to_serial`), None on the
    other ranks; every rank takes part (its layers are gathered)."""
    layers = model.layers
    lo, hi = model.layer_range
    mine = {n: {k: v.detach().clone() for k, v in layers.layer_tensors(n).items()}
            for n in range(lo, hi + 1)}
    gathered = model.comm.gather_object(mine, 0)
    if model.comm.rank != 0:
        return None
    tensors: dict[int, dict[str, Tensor]] = {}
    for part in gathered:
        tensors.update(part)
    requires_grad = [layers.params[n.replace(".", "__")].requires_grad for n in layers.names]
    steps = []
    for n in range(model.num_steps):
        f = copy.deepcopy(layers.template)
        for name, value in tensors[n].items():
            target = f.get_parameter(name) if name in layers.names else f.get_buffer(name)
            target.data = value.clone()
        for p, ref in zip(f.parameters(), requires_grad):
            p.requires_grad_(ref)
        steps.append(ResidualStep(f, model.h))
    return nn.Sequential(copy.deepcopy(model.opening), *steps, copy.deepcopy(model.closing))
