"""A rank's residual-network layers as stacked tensors, and the propagators built on them.

Every layer is the same module type (made by the user's factory); its parameters are kept
as one tensor per parameter name with a leading layer dimension, so a batch of intervals
can be advanced by one vmapped call over strided views of those tensors, and the layers
of one rank are a handful of tensors for the optimiser.

Forward:  Phi_n(u) = u + dt * f(u; theta_n)
Adjoint:  on the reversed grid, w -> w + dt * (df/du)(u_p; theta_p)^T w, with p the
          forward point where the corresponding forward step starts.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from .propagator import Step, StepBatch

_NORM_WITH_STATS = (nn.modules.batchnorm._NormBase,)


def _sanitize(name: str) -> str:
    return name.replace(".", "__")


def build_layers(factory: Callable[[], nn.Module], num_steps: int, keep: range
                 ) -> tuple[nn.Module, dict[int, nn.Module]]:
    """Call the factory once per layer, in layer order, keeping the layers in `keep`.

    Every rank draws the same random numbers in the same order as a serial
    `[factory() for _ in range(N)]`, so layer n starts from the same values whichever
    rank owns it. Returns a template (layer 0) and the kept layers; checks that all
    layers have the same parameters and no running statistics.
    """
    template = None
    kept: dict[int, nn.Module] = {}
    signature = None
    for n in range(num_steps):
        layer = factory()
        if not isinstance(layer, nn.Module):
            raise TypeError(f"the step factory must return an nn.Module, got {type(layer).__name__}")
        for sub in layer.modules():
            if isinstance(sub, _NORM_WITH_STATS) and sub.track_running_stats:
                raise ValueError(
                    f"the step module contains {type(sub).__name__} with running statistics: "
                    "MGRIT evaluates every layer several times per forward pass, which would "
                    "update them more than once; use track_running_stats=False, or a norm "
                    "without state (LayerNorm, GroupNorm)")
        sig = tuple((name, tuple(p.shape), p.dtype, p.requires_grad)
                    for name, p in layer.named_parameters())
        if signature is None:
            signature = sig
        elif sig != signature:
            raise ValueError(f"layer {n} from the step factory differs from layer 0 in its "
                             f"parameters (name, shape, dtype, requires_grad): {sig} vs {signature}")
        if template is None:
            template = copy.deepcopy(layer)
        if n in keep:
            kept[n] = layer
    if template is None:
        raise ValueError("num_steps must be >= 1")
    return template, kept


class LayerStack(nn.Module):
    """Layers first..last of a network (possibly none) with stacked parameters.

    `ghosts` holds copies of other ranks' layers that this rank's coarse steps use; they
    are refreshed by communication and never trained.
    """

    def __init__(self, template: nn.Module, layers: dict[int, nn.Module], first: int, last: int):
        super().__init__()
        self.first, self.last = first, last
        self.names = [name for name, _ in template.named_parameters()]
        self.buffer_names = [name for name, _ in template.named_buffers()]
        self.params = nn.ParameterDict()
        order = range(first, last + 1)
        for name in self.names:
            ref = dict(template.named_parameters())[name]
            rows = [dict(layers[n].named_parameters())[name].detach() for n in order]
            data = torch.stack(rows) if rows else ref.new_zeros((0, *ref.shape))
            self.params[_sanitize(name)] = nn.Parameter(data.clone(),
                                                        requires_grad=ref.requires_grad)
        for name in self.buffer_names:
            ref = dict(template.named_buffers())[name]
            rows = [dict(layers[n].named_buffers())[name] for n in order]
            data = torch.stack(rows) if rows else ref.new_zeros((0, *ref.shape))
            self.register_buffer("buf__" + _sanitize(name), data.clone())
        self.ghosts: dict[int, dict[str, Tensor]] = {}
        # The module structure that functional calls fill with a layer's tensors; kept out
        # of the registered submodules so its own weights are neither trained nor saved.
        template.requires_grad_(False)
        object.__setattr__(self, "template", template)

    @property
    def count(self) -> int:
        return self.last - self.first + 1 if self.last >= self.first else 0

    def tensors(self) -> dict[str, Tensor]:
        """Name -> stacked tensor (parameters and buffers), in the template's names."""
        out = {name: self.params[_sanitize(name)] for name in self.names}
        for name in self.buffer_names:
            out[name] = getattr(self, "buf__" + _sanitize(name))
        return out

    def layer_tensors(self, layer: int) -> dict[str, Tensor]:
        if self.first <= layer <= self.last:
            return {k: v[layer - self.first] for k, v in self.tensors().items()}
        if layer in self.ghosts:
            return self.ghosts[layer]
        raise KeyError(f"layer {layer} is neither owned ({self.first}..{self.last}) nor a "
                       "ghost on this rank")

    def rows(self, start: int, stride: int, count: int) -> dict[str, Tensor]:
        """Stacked tensors of layers start, start+stride, ... (a view when all are owned)."""
        end = start + stride * (count - 1)
        if self.first <= min(start, end) and max(start, end) <= self.last and stride > 0:
            lo = start - self.first
            return {k: v[lo: lo + stride * (count - 1) + 1: stride]
                    for k, v in self.tensors().items()}
        layers = [start + i * stride for i in range(count)]
        per_layer = [self.layer_tensors(n) for n in layers]
        return {k: torch.stack([t[k] for t in per_layer]) for k in per_layer[0]}

    def set_ghost(self, layer: int, flat: Tensor) -> None:
        """Unpack a layer sent by its owner (see `flatten_layer`)."""
        shapes = {k: v.shape[1:] for k, v in self.tensors().items()}
        out, offset = {}, 0
        for k, shape in shapes.items():
            size = int(torch.Size(shape).numel())
            out[k] = flat[offset: offset + size].view(shape).clone()
            offset += size
        self.ghosts[layer] = out

    def placeholder(self) -> dict[str, Tensor]:
        """Zero tensors of one layer's shapes and dtypes (for checking what f returns)."""
        return {k: v.new_zeros(v.shape[1:]) for k, v in self.tensors().items()}

    def flatten_layer(self, layer: int) -> Tensor:
        return torch.cat([t.detach().reshape(-1) for t in self.layer_tensors(layer).values()])

    def flat_size(self) -> int:
        return sum(int(v[0].numel()) if len(v) else int(torch.Size(v.shape[1:]).numel())
                   for v in self.tensors().values())

    # evaluation ----------------------------------------------------------------
    def f(self, tensors: dict[str, Tensor], u: Tensor) -> Tensor:
        return functional_call(self.template, tensors, (u,))

    def f_batch(self, tensors: dict[str, Tensor], states: Tensor) -> Tensor:
        return vmap(self.f)(tensors, states)


class NetworkPropagator:
    """Phi(u) = u + dt * f(u; theta_n): the forward steps of the residual network.

    Coarse steps use the layer where they start. `batched` switches `step_batch`, one
    vmapped call per batch of intervals, on or off.
    """

    def __init__(self, stack: LayerStack, batched: bool) -> None:
        self.stack = stack
        if batched:
            self.step_batch = self._step_batch

    def step(self, u: Tensor, s: Step) -> Tensor:
        return u + s.dt * self.stack.f(self.stack.layer_tensors(s.fine_index), u)

    def _step_batch(self, states: Tensor, steps: StepBatch) -> Tensor:
        m = steps.level_stride
        tensors = self.stack.rows(steps.start * m, steps.stride * m, steps.count)
        return states + steps.dt * self.stack.f_batch(tensors, states)


class AdjointPropagator:
    """The adjoint on the reversed grid: reversed step k of a level with stride M is the
    transposed linearisation of the forward step from point p = N - (k + 1) M over M fine
    steps, using layer p at the forward state u_p."""

    def __init__(self, stack: LayerStack, num_steps: int, strides: list[int], states: Tensor,
                 offset: int, batched: bool) -> None:
        self.stack = stack
        self.num_steps = num_steps
        self.strides = strides
        self.states = states        # forward states: row i holds point offset + i
        self.offset = offset
        if batched:
            self.step_batch = self._step_batch

    def _vjp(self, tensors: dict[str, Tensor], u: Tensor, w: Tensor) -> Tensor:
        return vjp(lambda x: self.stack.f(tensors, x), u)[1](w)[0]

    def step(self, w: Tensor, s: Step) -> Tensor:
        p = self.num_steps - s.fine_index - self.strides[s.level]
        u = self.states[p - self.offset]
        return w + s.dt * self._vjp(self.stack.layer_tensors(p), u, w)

    def _step_batch(self, ws: Tensor, steps: StepBatch) -> Tensor:
        m = self.strides[steps.level]
        first = self.num_steps - steps.start * m - m
        stride = -steps.stride * m
        points = torch.arange(first, first + stride * steps.count, stride)
        us = self.states.index_select(0, points - self.offset)
        tensors = self.stack.rows(first, stride, steps.count)
        return ws + steps.dt * vmap(self._vjp)(tensors, us, ws)


def parameter_gradients(stack: LayerStack, states: Tensor, adjoints: Tensor, dt: float,
                        batched: bool, chunk: int = 256) -> dict[str, Tensor]:
    """dL/dtheta_n = dt * (df/dtheta)(u_n; theta_n)^T w_{n+1} for the owned layers.

    `states[i]` is u at layer first+i's start, `adjoints[i]` the adjoint w after it. Each
    layer is independent, so they are done in vmapped chunks (or one by one).
    """
    names = stack.names
    grads = {name: torch.zeros_like(stack.params[_sanitize(name)]) for name in names}
    if stack.count == 0 or not names:
        return grads
    buffers = {name: getattr(stack, "buf__" + _sanitize(name)) for name in stack.buffer_names}
    params = {name: stack.params[_sanitize(name)].detach() for name in names}

    def one(p: dict[str, Tensor], b: dict[str, Tensor], u: Tensor, w: Tensor) -> dict[str, Tensor]:
        return vjp(lambda q: stack.f({**q, **b}, u), p)[1](w)[0]

    for lo in range(0, stack.count, chunk if batched else 1):
        hi = min(lo + (chunk if batched else 1), stack.count)
        p = {k: v[lo:hi] for k, v in params.items()}
        b = {k: v[lo:hi] for k, v in buffers.items()}
        if batched:
            out = vmap(one)(p, b, states[lo:hi], adjoints[lo:hi])
        else:
            single = one({k: v[0] for k, v in p.items()}, {k: v[0] for k, v in b.items()},
                         states[lo], adjoints[lo])
            out = {k: v[None] for k, v in single.items()}
        for name in names:
            grads[name][lo:hi] = dt * out[name]
    return grads
