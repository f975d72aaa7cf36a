"""The step strategy of a rank's layers: the hand-written kernels of
`mgrit.kernels.strategies` for chains of Linear, Conv2d and activations, and `ModuleSteps`
(torch.func) for any other step module; chosen once per propagator and solve
(`StepSelection`) and checked against `mgrit.kernels.contract`."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.func import functional_call, vjp, vmap

from ...kernels.choice import native_backend
from ...kernels.contract import Kept, StepStrategy, Tensors, check_strategy
from ...kernels.strategies import chain_steps
from . import randomness as draws
from .precision import autocasting
from .stack import LayerStack


class ModuleSteps:
    """Any step module: single steps call the layer's module; batches go through the
    module's own `forward_batched` where it has one (`mgrit.nn.TransformerBlock`), else
    through `vmap(functional_call)`, or layer by layer where the module draws from torch's
    generator (each layer seeded with its key, so every evaluation draws the same); adjoints
    by autograd through the same calls. No op outputs are kept.

    The stack's `context` (tensors constant over depth) goes to every call as keyword
    arguments; where a context tensor requires grad, the final fine sweep's VJPs also give
    its cotangent per layer (recorded under the key `CONTEXT + name`)."""

    skips_zeros = False
    keeps_values = False

    def __init__(self, stack: LayerStack) -> None:
        self.stack = stack

    # forward ------------------------------------------------------------------------
    def _f(self, t: Tensors, u: Tensor, context: Tensors) -> Tensor:
        return functional_call(self.stack.template, t, (u,), context)

    def _f_keyed(self, t: Tensors, u: Tensor, context: Tensors, key: Tensor) -> Tensor:
        with draws.keyed(key):
            return self._f(t, u, context)

    def step(self, layer: int, t: Tensors, u: Tensor, dt: float) -> Tensor:
        module = self.stack.module(layer)
        with seeded(self.stack):
            return u + dt * module(u, **self.stack.context)

    def _evaluate(self, t: Tensors, states: Tensor, context: Tensors) -> Tensor:
        """f of a batch of layers (leading dimension of t and states)."""
        stack = self.stack
        keys = draws.active()
        if stack.batched:
            return stack.template.forward_batched(t, states, **context)
        if keys is None:
            return vmap(self._f, in_dims=(0, 0, None))(t, states, context)
        if stack.torch_random:
            rows = []
            for i in range(len(states)):
                with draws.keyed(keys[i]), seeded(stack):
                    rows.append(self._f({k: v[i] for k, v in t.items()}, states[i], context))
            return torch.stack(rows)
        return vmap(self._f_keyed, in_dims=(0, 0, None, 0))(t, states, context, keys)

    def batch(self, t: Tensors, states: Tensor, dt: float) -> Tensor:
        return torch.add(states, self._evaluate(t, states, self.stack.context), alpha=dt)

    def wants_values(self, want_params: bool) -> bool:
        return False

    # adjoint --------------------------------------------------------------------------
    def vjp(self, t: Tensors, us: Tensor, ws: Tensor, dt: float, values: None,
            want_params: bool) -> tuple[Tensor, Tensors | None]:
        stack = self.stack
        names = stack.names
        context = stack.context
        params = {k: v for k, v in t.items() if k in names}
        buffers = {k: v for k, v in t.items() if k not in names}
        live = ({k: v for k, v in context.items() if v.requires_grad} if want_params else {})
        if stack.batched or stack.torch_random:
            du, dp, dc = self._vjp_autograd(params, buffers, us, ws, context, live)
        else:
            keys = draws.active()

            def one(p: Tensors, b: Tensors, c: Tensors, u: Tensor, w: Tensor,
                    key: Tensor | None) -> tuple[Tensor, Tensors, Tensors]:
                def f(q: Tensors, d: Tensors, x: Tensor) -> Tensor:
                    ctx = {**context, **d}
                    if key is None:
                        return self._f({**q, **b}, x, ctx)
                    return self._f_keyed({**q, **b}, x, ctx, key)
                dp, dc, du = vjp(f, p, c, u)[1](w)
                return du, dp, dc
            du, dp, dc = vmap(one, in_dims=(0, 0, None, 0, 0, 0 if keys is not None else None)
                              )(params, buffers, live, us, ws, keys)
        if not want_params:
            return torch.add(ws, du, alpha=dt), None
        dp = dict(dp)
        for name, value in dc.items():
            dp[CONTEXT + name] = value
        return torch.add(ws, du, alpha=dt), dp

    def _vjp_autograd(self, params: Tensors, buffers: Tensors, us: Tensor, ws: Tensor,
                      context: Tensors, live: Tensors
                      ) -> tuple[Tensor, Tensors, Tensors]:
        """(df/du)^T w, (df/dtheta)^T w per layer and (df/dc)^T w per layer by autograd
        through `_evaluate` (one graph for the batch; its layers are independent, so the
        cotangent of a row of the stacked parameters is that layer's)."""
        with torch.enable_grad():
            p = {k: v.detach().requires_grad_() for k, v in params.items()}
            x = us.detach().requires_grad_()
            rows = len(us)
            # per-layer copies of the context tensors that need a cotangent: expanding a
            # leaf over the batch lets autograd give each layer its own
            c = {k: v.detach()[None].expand(rows, *v.shape).clone().requires_grad_()
                 for k, v in live.items()}
            y = self._evaluate_rows({**p, **buffers}, x, context, c)
            inputs = [x, *p.values(), *c.values()]
            grads = torch.autograd.grad(y, inputs, ws, allow_unused=True)
        du = grads[0]
        dp = {k: (g if g is not None else torch.zeros_like(p[k]))
              for k, g in zip(p, grads[1:1 + len(p)])}
        dc = {k: (g if g is not None else torch.zeros_like(c[k]))
              for k, g in zip(c, grads[1 + len(p):])}
        return (du if du is not None else torch.zeros_like(us)), dp, dc

    def _evaluate_rows(self, t: Tensors, x: Tensor, context: Tensors, rows: Tensors) -> Tensor:
        """`_evaluate`, where the context tensors in `rows` are given per layer (leading
        dimension) so that each layer's cotangent comes out separately."""
        if not rows:
            return self._evaluate(t, x, context)
        stack = self.stack
        keys = draws.active()
        outs = []
        for i in range(len(x)):
            ctx = {**context, **{k: v[i] for k, v in rows.items()}}
            tt = {k: v[i: i + 1] for k, v in t.items()}
            if stack.batched:
                with draws.keyed(keys[i: i + 1] if keys is not None else None):
                    outs.append(stack.template.forward_batched(tt, x[i: i + 1], **ctx))
            else:
                with draws.keyed(keys[i] if keys is not None else None), seeded(stack):
                    outs.append(self._f({k: v[0] for k, v in tt.items()}, x[i], ctx)[None])
        return torch.cat(outs)

    def vjp_single(self, layer: int, u: Tensor, w: Tensor, dt: float) -> Tensor:
        """w + dt (df/du)^T w for one layer at state u, by autograd through its module."""
        with torch.enable_grad(), seeded(self.stack):
            x = u.detach().requires_grad_()
            y = self.stack.module(layer)(x, **self.stack.context)
            return w + dt * torch.autograd.grad(y, x, w)[0]


# prefix of a context tensor's per-layer cotangents among a batch's recorded cotangents
CONTEXT = "\0context:"


def seeded(stack: LayerStack):
    """Where the step module draws from torch's generator: the generator of the states'
    device, seeded with the active key for the evaluation inside (and restored after)."""
    if not (stack.torch_random and stack.training):
        return contextlib.nullcontext()
    key = draws.active()
    return draws.seeded(int(key) if key is not None else 0,
                        next(iter(stack.tensors().values())).device)


class StepSelection:
    """The strategy of one propagator's states (shape, dtype and device fixed by its
    solver), chosen again only when the kernels choice changes (the stack's `kernels`,
    resolved by `mgrit.kernels.choice.native_backend` once per solve: where it is None the
    environment's default may change between solves) or autocast is switched on or off.
    Under autocast, and where the states' dtype is not the parameters' (a forward pass
    that autocast began, its adjoint), torch's own ops compute (`ModuleSteps`): the
    hand-written kernels compute in one dtype and know nothing of autocast's casts."""

    def __init__(self, stack: LayerStack, like: Tensor) -> None:
        self.stack = stack
        self._state = (like.shape, like.dtype, like.device)
        self._chosen: dict[tuple[str, bool], StepStrategy] = {}
        self.backend = native_backend(stack.kernels)    # the resolved choice of this solve
        self._mixed = any(t.is_floating_point() and t.dtype != like.dtype
                          for t in stack.tensors().values())

    def current(self) -> StepStrategy:
        """The strategy of this solve, checked against its contract when first chosen."""
        self.backend = backend = native_backend(self.stack.kernels)
        # context inputs go to the module's own forward: only the general path takes them
        key = (backend, bool(self.stack.context) or autocasting(self._state[2])
               or self._mixed)
        steps = self._chosen.get(key)
        if steps is None:
            chain = self.stack.chain
            steps = self._chosen[key] = (
                ModuleSteps(self.stack) if chain is None or key[1]
                else chain_steps(chain, *self._state, backend))
            check_strategy(steps)
        return steps



__all__ = ["CONTEXT", "Kept", "ModuleSteps", "StepSelection", "Tensors"]
