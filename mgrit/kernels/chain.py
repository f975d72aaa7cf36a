"""Hand-written kernels for step modules that are chains of nn.Linear, same-padded stride-1
nn.Conv2d and simple activations: forward, input VJP and parameter VJP over a stack of
layers (one entry per interval of a relaxation batch)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import native
from .choice import _native_chosen

# backward of an activation from its output y and the output cotangent g (fused aten ops)
_ACTIVATION_BACKWARD: dict[type, Callable[[nn.Module, Tensor, Tensor], Tensor]] = {
    nn.Tanh: lambda m, g, y: torch.ops.aten.tanh_backward(g, y),
    nn.Sigmoid: lambda m, g, y: torch.ops.aten.sigmoid_backward(g, y),
    nn.ReLU: lambda m, g, y: torch.ops.aten.threshold_backward(g, y, 0.0),
    nn.LeakyReLU: lambda m, g, y: torch.where(y > 0, g, g * m.negative_slope),
    nn.Identity: lambda m, g, y: g,
}

# A chain passes values between its ops either stacked, a tensor (B, ...) with one entry
# per layer of the batch, or as a list of B tensors: convolutions run one layer at a time,
# so chains of convolutions never stack until their end.
Values = "Tensor | list[Tensor]"


def _stacked(x: "Tensor | list[Tensor]") -> Tensor:
    return torch.stack(x) if isinstance(x, list) else x


class _Linear:
    """nn.Linear over a stack of layers: batched matrix products."""

    fresh_output = True

    def __init__(self, weight: str, bias: str | None) -> None:
        self.weight, self.bias = weight, bias

    def forward(self, t: dict[str, Tensor], x: Values) -> Tensor:
        x = _stacked(x)
        flat = x if x.dim() == 3 else x.reshape(x.shape[0], -1, x.shape[-1])
        w = t[self.weight].transpose(1, 2)
        y = (torch.baddbmm(t[self.bias][:, None, :], flat, w) if self.bias
             else torch.bmm(flat, w))
        return y if x.dim() == 3 else y.reshape(*x.shape[:-1], y.shape[-1])

    def single(self, t: dict[str, Tensor], x: Tensor) -> Tensor:
        return F.linear(x, t[self.weight], t[self.bias] if self.bias else None)

    def backward(self, t: dict[str, Tensor], x: Values, y: Values, g: Values,
                 grads: dict[str, Tensor] | None, need_input: bool) -> Tensor | None:
        x, g = _stacked(x), _stacked(g)
        flat = g.dim() == 3
        flat_g = g if flat else g.reshape(g.shape[0], -1, g.shape[-1])
        if grads is not None:
            grads[self.weight] = torch.bmm(flat_g.transpose(1, 2), x if flat else
                                           x.reshape(x.shape[0], -1, x.shape[-1]))
            if self.bias:
                grads[self.bias] = flat_g.sum(1)
        if not need_input:
            return None
        du = torch.bmm(flat_g, t[self.weight])
        return du if flat else du.reshape(x.shape)

    def single_backward(self, t: dict[str, Tensor], g: Tensor) -> Tensor:
        return torch.matmul(g, t[self.weight])


def _conv2d(x: Tensor, w: Tensor, b: Tensor | None, padding: tuple[int, int],
            native_allowed: bool | None) -> Tensor:
    """A 'same' stride-1 convolution, native or torch's (`_native_chosen`)."""
    def ours(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return native.conv2d(x, w, b)

    def theirs(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return F.conv2d(x, w, b, padding=padding)

    chosen = _native_chosen("conv2d", (ours, theirs), (x, w, b), native_allowed)
    return (ours if chosen else theirs)(x, w, b)


def _conv2d_weight(x: Tensor, w: Tensor, g: Tensor, padding: tuple[int, int],
                   native_allowed: bool | None) -> Tensor:
    """The gradient of _conv2d(x, w) with respect to w for the output cotangent g."""
    def ours(x: Tensor, w: Tensor, g: Tensor) -> Tensor:
        return native.conv2d_weight(x, w.shape, g)

    def theirs(x: Tensor, w: Tensor, g: Tensor) -> Tensor:
        return torch.nn.grad.conv2d_weight(x, w.shape, g, padding=padding)

    chosen = _native_chosen("conv2d_weight", (ours, theirs), (x, w, g), native_allowed)
    return (ours if chosen else theirs)(x, w, g)


class _Conv2d:
    """A 'same' stride-1 nn.Conv2d over a stack of layers, one layer at a time (a CPU
    runs one convolution per layer faster than a grouped one). The input gradient is a
    convolution with the flipped, transposed kernel, several times faster on a CPU than
    the transposed convolution autograd uses."""

    fresh_output = True

    def __init__(self, weight: str, bias: str | None, padding: tuple[int, int],
                 native_allowed: bool | None = None) -> None:
        self.weight, self.bias, self.padding = weight, bias, padding
        # whether native convolutions may run (None: as MGRIT_NATIVE has it)
        self.native_allowed = native_allowed

    def forward(self, t: dict[str, Tensor], x: Values) -> list[Tensor]:
        w, b = t[self.weight], t[self.bias] if self.bias else None
        return [_conv2d(x[i], w[i], None if b is None else b[i], self.padding, self.native_allowed)
                for i in range(len(x))]

    def single(self, t: dict[str, Tensor], x: Tensor) -> Tensor:
        return _conv2d(x, t[self.weight], t[self.bias] if self.bias else None, self.padding,
                       self.native_allowed)

    def backward(self, t: dict[str, Tensor], x: Values, y: Values, g: Values,
                 grads: dict[str, Tensor] | None, need_input: bool) -> list[Tensor] | None:
        w = t[self.weight]
        if grads is not None:
            grads[self.weight] = torch.stack([_conv2d_weight(x[i], w[i], g[i], self.padding,
                                                             self.native_allowed)
                                              for i in range(len(x))])
            if self.bias:
                grads[self.bias] = torch.stack([g[i].sum((0, 2, 3)) for i in range(len(x))])
        if not need_input:
            return None
        return [_conv2d(g[i], w[i].transpose(0, 1).flip(2, 3), None, self.padding,
                        self.native_allowed)
                for i in range(len(x))]

    def single_backward(self, t: dict[str, Tensor], g: Tensor) -> Tensor:
        return _conv2d(g, t[self.weight].transpose(0, 1).flip(2, 3), None, self.padding,
                       self.native_allowed)


class _Activation:
    fresh_output = False

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def forward(self, t: dict[str, Tensor], x: Values, inplace: bool = False) -> Values:
        """In place when x is a fresh output of the op before (never the chain's input)."""
        fn = self.module
        if isinstance(x, list):
            return [_apply_activation(fn, v, inplace) for v in x]
        return _apply_activation(fn, x, inplace)

    def single(self, t: dict[str, Tensor], x: Tensor, inplace: bool = False) -> Tensor:
        return _apply_activation(self.module, x, inplace)

    def backward(self, t: dict[str, Tensor], x: Values, y: Values, g: Values,
                 grads: dict[str, Tensor] | None, need_input: bool) -> Values:
        back = _ACTIVATION_BACKWARD[type(self.module)]
        if isinstance(y, list):
            return [back(self.module, g[i], y[i]) for i in range(len(y))]
        return back(self.module, _stacked(g), y)

    def single_backward(self, g: Tensor, y: Tensor) -> Tensor:
        return _ACTIVATION_BACKWARD[type(self.module)](self.module, g, y)


def _apply_activation(fn: nn.Module, x: Tensor, inplace: bool) -> Tensor:
    if not inplace or type(fn) is nn.Identity:
        return fn(x)
    if type(fn) is nn.ReLU:
        return x.relu_()
    if type(fn) is nn.Tanh:
        return x.tanh_()
    if type(fn) is nn.Sigmoid:
        return x.sigmoid_()
    return fn(x)


def _chain_op(name: str, mod: nn.Module) -> "_Linear | _Conv2d | _Activation | None":
    if type(mod) is nn.Linear:
        return _Linear(name + "weight", name + "bias" if mod.bias is not None else None)
    if type(mod) is nn.Conv2d:
        k = mod.kernel_size
        pad = mod.padding
        if pad == "same":
            pad = (k[0] // 2, k[1] // 2)
        if (mod.stride == (1, 1) and mod.dilation == (1, 1) and mod.groups == 1
                and mod.padding_mode == "zeros" and isinstance(pad, tuple)
                and all(2 * p == kk - 1 for p, kk in zip(pad, k))):
            return _Conv2d(name + "weight", name + "bias" if mod.bias is not None else None,
                           pad)
        return None
    if type(mod) in _ACTIVATION_BACKWARD and not getattr(mod, "inplace", False):
        return _Activation(mod)
    return None


class Chain:
    """Hand-written kernels for a step module that is a chain of nn.Linear, 'same'
    stride-1 nn.Conv2d and simple activations (Tanh, Sigmoid, ReLU, LeakyReLU, Identity):
    forward, input VJP and parameter VJP over a stack of layers. Linear layers become
    batched matrix products, several times cheaper than a vmapped functional call;
    convolutions avoid autograd's slow transposed convolution. `of(template)` is None
    for any other module, which then goes through torch.func."""

    def __init__(self, ops: list) -> None:
        self.ops = ops
        # whether op i's batched output is a list of per-layer tensors (convolutions and
        # what follows them) rather than one stacked tensor
        self.listed: list[bool] = []
        listed = False
        for op in ops:
            listed = isinstance(op, _Conv2d) or (listed and isinstance(op, _Activation))
            self.listed.append(listed)

    @classmethod
    def of(cls, template: nn.Module) -> "Chain | None":
        if isinstance(template, nn.Sequential):
            named = [(f"{i}.", mod) for i, mod in enumerate(template)]
        else:
            named = [("", template)]
        ops = [_chain_op(name, mod) for name, mod in named]
        if not ops or any(op is None for op in ops) or any(True for _ in template.buffers()):
            return None
        return cls(ops)

    def allowing_native(self, allowed: bool) -> "Chain":
        """The same chain with its convolutions told whether native kernels may run (a
        network's `kernels` choice), rather than reading MGRIT_NATIVE at every call."""
        return Chain([_Conv2d(op.weight, op.bias, op.padding, allowed)
                      if isinstance(op, _Conv2d) else op for op in self.ops])

    def _run(self, t: dict[str, Tensor], x: Tensor) -> list:
        values = [x]
        for i, op in enumerate(self.ops):
            if isinstance(op, _Activation):
                fresh = i > 0 and self.ops[i - 1].fresh_output
                values.append(op.forward(t, values[-1], inplace=fresh))
            else:
                values.append(op.forward(t, values[-1]))
        return values

    def forward(self, t: dict[str, Tensor], x: Tensor, stack: bool = True
                ) -> "Tensor | list[Tensor]":
        """f(x) for a stack of layers; unless `stack`, a convolution chain's result stays a
        list of per-layer tensors."""
        out = self._run(t, x)[-1]
        return _stacked(out) if stack else out

    def forward_values(self, t: dict[str, Tensor], x: Tensor) -> tuple["Tensor | list", list]:
        """f(x) for a stack of layers, stacked or as a list of per-layer tensors
        (convolution chains), whichever it comes out as, and every op's output (per op,
        stacked or a list, indexed by layer of the stack): what `gather_values` takes."""
        values = self._run(t, x)
        return values[-1], values[1:]

    def gather_values(self, x: Tensor, kept: list[tuple[list, int]]) -> list:
        """The `values` argument of `vjp` for a stack of layers whose op outputs were kept:
        kept[n] = (outputs, k) says layer n's are outputs[i][k] for op i. Evenly spaced
        entries of one kept batch, in its order or reversed, are taken as slices; anything
        else layer by layer."""
        first, count = kept[0][0], len(kept)
        index = [k for _, k in kept]
        step = index[1] - index[0] if count > 1 else 0
        # one kept batch at evenly spaced indices (a coarse level's layers are every M-th)
        regular = (step != 0 and all(outputs is first for outputs, _ in kept)
                   and index == list(range(index[0], index[0] + step * count, step)))
        values: list = [x]
        for i, listed in enumerate(self.listed):
            if regular:
                lo = min(index[0], index[-1])
                v = first[i][lo: lo + abs(step) * (count - 1) + 1: abs(step)]
                if step < 0:
                    v = v[::-1] if listed else v.flip(0)
            else:
                items = [outputs[i][k] for outputs, k in kept]
                v = items if listed else torch.stack(items)
            values.append(v)
        return values

    def single(self, t: dict[str, Tensor], x: Tensor, keep: list | None = None) -> Tensor:
        """f(x) for one layer (t holds that layer's tensors, x one state): plain calls,
        activations in place on the fresh output of the op before them. `keep`, a list,
        receives every op's output."""
        for i, op in enumerate(self.ops):
            if isinstance(op, _Activation):
                x = op.single(t, x, inplace=i > 0 and self.ops[i - 1].fresh_output)
            else:
                x = op.single(t, x)
            if keep is not None:
                keep.append(x)
        return x

    def single_vjp(self, t: dict[str, Tensor], g: Tensor, outputs: list[Tensor]) -> Tensor:
        """(df/dx)^T g for one layer and one state x, with plain calls, from the ops'
        outputs at x (`single(t, x, keep)` gives them): the sequential march's step of the
        adjoint, where a batch of one would cost more in overhead than in arithmetic."""
        for i in range(len(self.ops) - 1, -1, -1):
            op = self.ops[i]
            g = (op.single_backward(g, outputs[i]) if isinstance(op, _Activation)
                 else op.single_backward(t, g))
        return g

    def vjp(self, t: dict[str, Tensor], x: Tensor, g: Tensor, want_input: bool = True,
            want_params: bool = False, values: list | None = None
            ) -> tuple[Tensor | None, dict[str, Tensor] | None]:
        """The input cotangent and/or the parameter cotangents, from one forward pass
        (none when `values`, from `gather_values`, holds the ops' outputs at x)."""
        if values is None:
            values = self._run(t, x)
        grads: dict[str, Tensor] | None = {} if want_params else None
        for i in range(len(self.ops) - 1, -1, -1):
            g = self.ops[i].backward(t, values[i], values[i + 1], g, grads,
                                     need_input=want_input or i > 0)
        return (_stacked(g) if want_input else None), grads


