"""Getting a layer-parallel network out as a plain serial one: from a checkpoint's files
(`serial_state_dict`, in one process without MPI) or from a live model (`to_serial`)."""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING

from torch import Tensor

from .checkpoint import read_set, verify
from .serial import ResidualNetwork, ResidualStep

if TYPE_CHECKING:
    from .layer_parallel import LayerParallel


def serial_state_dict(directory: str | os.PathLike) -> dict[str, Tensor]:
    """The `state_dict` of the plain serial network equivalent to the checkpoint in
    `directory` (what `LayerParallel.to_serial().state_dict()` gives: keys `0.*` for the
    opening, `{n+1}.f.*` for layer n, `{num_steps+1}.*` for the closing), read in one
    process without MPI from the files of any number of ranks. Load it into
    `mgrit.serial_resnet(step, num_steps, t_final, opening, closing)`. Of a data-parallel
    checkpoint it reads replica 0 (the replicas hold the same weights)."""
    files = read_set(directory, None, None, 0, None)
    for f in files:
        verify(f)
    first = files[0]
    num_steps = first.state["layout"]["num_steps"]
    params = {"layers.params." + n.replace(".", "__"): n
              for n, _ in first.state["layout"]["parameters"]}
    out: dict[str, Tensor] = {}
    for key, value in first.state["model"].items():
        if key.startswith("opening."):
            out["0." + key[len("opening."):]] = value.clone()
    # LayerStack stores a step module's tensor `a.b` as `params.a__b` or `buf__a__b`
    stacked = {key: params.get(key) or key[len("layers.buf__"):].replace("__", ".")
               for key in first.state["model"] if key.startswith("layers.")}
    for f in files:
        a, b = f.layers
        for n in range(a, b + 1):
            for key, name in stacked.items():
                out[f"{n + 1}.f.{name}"] = f.state["model"][key][n - a].clone()
    for key, value in first.state["model"].items():
        if key.startswith("closing."):
            out[f"{num_steps + 1}." + key[len("closing."):]] = value.clone()
    return out


def to_serial(model: LayerParallel) -> ResidualNetwork | None:
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
        steps.append(ResidualStep(f, model.h, n))
    return ResidualNetwork(copy.deepcopy(model.opening), *steps, copy.deepcopy(model.closing))
