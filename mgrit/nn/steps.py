"""The step strategy of a rank's layers: the hand-written kernels of `mgrit.kernels.steps`
for chains of Linear, Conv2d and activations, and `ModuleSteps` (torch.func) for any other
step module; chosen once per propagator and solve (`select_steps`)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import functional_call, vjp, vmap

from ..kernels.choice import native_backend
from ..kernels.steps import ChainSteps, Kept, Tensors, chain_steps
from .stack import LayerStack


class ModuleSteps:
    """Any step module: single steps call the layer's module, batches go through
    `vmap(functional_call)`, adjoints through `torch.func.vjp`. No op outputs are kept."""

    skips_zeros = False
    keeps_values = False

    def __init__(self, stack: LayerStack) -> None:
        self.stack = stack

    def _f(self, t: Tensors, u: Tensor) -> Tensor:
        return functional_call(self.stack.template, t, (u,))

    def step(self, layer: int, t: Tensors, u: Tensor, dt: float) -> Tensor:
        return u + dt * self.stack.module(layer)(u)

    def batch(self, t: Tensors, states: Tensor, dt: float) -> Tensor:
        return torch.add(states, vmap(self._f)(t, states), alpha=dt)

    def wants_values(self, want_params: bool) -> bool:
        return False

    def vjp(self, t: Tensors, us: Tensor, ws: Tensor, dt: float, values: None,
            want_params: bool) -> tuple[Tensor, Tensors | None]:
        names = self.stack.names
        params = {k: v for k, v in t.items() if k in names}
        buffers = {k: v for k, v in t.items() if k not in names}

        def one(p: Tensors, b: Tensors, u: Tensor, w: Tensor) -> tuple[Tensor, Tensors]:
            dp, du = vjp(lambda q, x: self._f({**q, **b}, x), p, u)[1](w)
            return du, dp
        du, dp = vmap(one)(params, buffers, us, ws)
        return torch.add(ws, du, alpha=dt), (dp if want_params else None)

    def vjp_single(self, layer: int, u: Tensor, w: Tensor, dt: float) -> Tensor:
        """w + dt (df/du)^T w for one layer at state u, by autograd through its module."""
        with torch.enable_grad():
            x = u.detach().requires_grad_()
            y = self.stack.module(layer)(x)
            return w + dt * torch.autograd.grad(y, x, w)[0]


class StepSelection:
    """The strategy of one propagator's states (shape, dtype and device fixed by its
    solver), chosen again only when whether native kernels may run changes
    (`mgrit.kernels.choice.native_backend`, read once per solve)."""

    def __init__(self, stack: LayerStack, like: Tensor) -> None:
        self.stack = stack
        self._state = (like.shape, like.dtype, like.device)
        self._chosen: dict[bool, ChainSteps | ModuleSteps] = {}

    def current(self) -> ChainSteps | ModuleSteps:
        native = native_backend() != "torch"
        steps = self._chosen.get(native)
        if steps is None:
            chain = self.stack.chain
            steps = self._chosen[native] = (ModuleSteps(self.stack) if chain is None
                                            else chain_steps(chain, *self._state, native))
        return steps


__all__ = ["Kept", "ModuleSteps", "StepSelection", "Tensors"]
