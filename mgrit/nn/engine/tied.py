"""Weights tied across depth: a step factory that returns the same module for every layer
(a neural ODE's one vector field, f(u; theta) at every step).

The layers keep their stacked per-layer rows (the solvers and kernels read those), filled
from the one module's parameters before every pass and never trained themselves; the
optimizer sees the module's parameters only, whose gradient is the sum of every layer's on
every rank, as autograd gives it for the serial network built from the same factory.
Layers that share only some parameters, or only with some other layers, are refused."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ...comm import Comm

if TYPE_CHECKING:
    from .stack import LayerStack


class Sharing:
    """Which parameters the factory's layers share, checked layer by layer as they are
    made: none (independent layers), all with layer 0 (`tied`: one module for every
    layer), or anything else, refused. Frozen parameters (requires_grad=False) are never
    updated, so per-layer copies of them stay equal: they may be shared in any way."""

    def __init__(self) -> None:
        # the parameters seen so far, by id, held weakly: an id found again (and still the
        # same live object) is a parameter shared between layers
        self._seen: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._owner: dict[int, tuple[int, str]] = {}
        self.tied: nn.Module | None = None

    def check(self, layer: nn.Module, n: int) -> None:
        trainable = [(name, p) for name, p in layer.named_parameters(remove_duplicate=False)
                     if p.requires_grad]
        shared = [(name, p) for name, p in trainable
                  if self._seen.get(id(p)) is p and self._owner[id(p)][0] != n]
        whole = bool(trainable) and all(self._seen.get(id(p)) is p
                                        and self._owner[id(p)][0] == 0
                                        for _, p in trainable)
        if n == 1 and whole:
            self.tied = layer
        elif n > 0 and (self.tied is not None) != whole or (shared and not whole):
            self._refuse(n, shared or trainable)
        for name, p in trainable:
            self._seen.setdefault(id(p), p)
            self._owner.setdefault(id(p), (n, name))

    def _refuse(self, n: int, params: list[tuple[str, Tensor]]) -> None:
        name, p = params[0]
        first = self._owner.get(id(p), (n, name)) if self._seen.get(id(p)) is p else None
        what = (f"gave layer {n} the parameter {name!r} of layer {first[0]} "
                f"({first[1]!r} there)" if first is not None and first[0] != n else
                f"tied layers 0..{n - 1} to one module but not layer {n}")
        raise ValueError(
            f"the step factory {what}: layers may share all their parameters (one module "
            "returned for every layer, weights tied across depth) or none; sharing some "
            "parameters, or with some layers only, is not supported. Return a new module "
            "from each call, or the same module from every call")


class TiedWeights:
    """The one module of a tied network and the stacked rows of a rank's layers."""

    def __init__(self, module: nn.Module, layers: "LayerStack", comm: Comm) -> None:
        self.module = module
        self.layers = layers
        self.comm = comm
        for param in layers.params.values():
            param.requires_grad_(False)     # the module's parameters are the trained ones

    def parameters(self) -> list[nn.Parameter]:
        """The module's parameters in the layers' parameter order."""
        return [self.module.get_parameter(name) for name in self.layers.names]

    def fill_rows(self) -> None:
        """Every layer's row := the module's current values (the optimizer changed them)."""
        with torch.no_grad():
            for name, param in zip(self.layers.names, self.parameters()):
                rows = self.layers.params[name.replace(".", "__")]
                if rows.numel():
                    rows.copy_(param.detach().expand_as(rows))

    def gradients(self, grads: dict[str, Tensor]) -> list[Tensor | None]:
        """dL/dtheta of the module: the rank's layers' gradients summed, then summed over
        the ranks in one allreduce (every rank gets the same)."""
        params = self.parameters()
        sums = [grads[name].sum(0) for name in self.layers.names]
        flat = torch.cat([s.reshape(-1) for s in sums])
        self.comm.allreduce_sum_(flat)
        out, offset = [], 0
        for s, param in zip(sums, params):
            out.append(flat[offset: offset + s.numel()].view_as(s) if param.requires_grad
                       else None)
            offset += s.numel()
        return out
