"""Residual steps of a stack of layers, u + dt f(u), and their adjoints, as strategies chosen
once per layer kind, device and dtype (`chain_steps`) instead of at every call.

Each is a `StepStrategy` (`mgrit.kernels.contract` has the methods and what they compute),
checked once per class when it is chosen.

`ChainSteps` runs torch's kernels for a `Chain`; `NativeDenseSteps` and `CudaDenseSteps` run
the hand-written kernels of a `Linear(d, d) -> Tanh` step on a CPU and a GPU, and fall back
to `ChainSteps` where an operand's layout does not suit them. `skips_zeros` says whether a
strategy's adjoint handles all-zero cotangents itself (the native kernels check in C).
"""

from __future__ import annotations

import math
import sys
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from . import native
from .chain import Chain, _Activation, _Linear
from .choice import native_allowed
from .contract import Kept, Tensors
from .dense import DENSE_NATIVE_MAX_VALUES, DenseProgram, NativeDense, TorchDense


def add_step(out: Tensor, u: Tensor, f: Tensor, dt: float, g: Tensor | None) -> None:
    """out = g + u + dt * f (g None: no g), in place: a step's update written into its row."""
    torch.add(u, f, alpha=dt, out=out)
    if g is not None:
        out.add_(g)


def single_kept(outputs: list) -> Kept:
    """Kept outputs of one layer from its ops' outputs (one tensor per op)."""
    return [[y] for y in outputs], 0


class ChainSteps:
    """Torch's kernels for a step module that is a `Chain` (Linear, same-padded Conv2d and
    simple activations): batched matrix products and per-layer convolutions, hand-written
    VJPs (see `mgrit.kernels.chain`)."""

    skips_zeros = False
    keeps_values = True         # single and batched steps can return their op outputs

    def __init__(self, chain: Chain) -> None:
        self.chain = chain

    # forward ---------------------------------------------------------------------------
    def step(self, layer: int, t: Tensors, u: Tensor, dt: float) -> Tensor:
        return u + dt * self.chain.single(t, u)

    def step_into(self, layer: int, t: Tensors, u: Tensor, dt: float, out: Tensor,
                  g: Tensor | None, keep: bool) -> Kept | None:
        outputs: list | None = [] if keep else None
        add_step(out, u, self.chain.single(t, u, outputs), dt, g)
        return None if outputs is None else single_kept(outputs)

    def batch(self, t: Tensors, states: Tensor, dt: float) -> Tensor:
        return torch.add(states, self.chain.forward(t, states), alpha=dt)

    def batch_into(self, t: Tensors, states: Tensor, dt: float, out: Tensor, g: Tensor | None,
                   keep: bool) -> list | None:
        """Written layer by layer from the chain's outputs: no stacked temporary, no copy."""
        outputs = None
        if keep:
            f, outputs = self.chain.forward_values(t, states)
        else:
            f = self.chain.forward(t, states, stack=False)
        if isinstance(f, list):
            for i, fi in enumerate(f):
                torch.add(states[i], fi, alpha=dt, out=out[i])
            if g is not None:
                out.add_(g)
        else:
            add_step(out, states, f, dt, g)
        return outputs

    # adjoint ---------------------------------------------------------------------------
    def values(self, t: Tensors, us: Tensor) -> list:
        return self.chain.forward_values(t, us)[1]

    def single_values(self, layer: int, t: Tensors, u: Tensor) -> Kept:
        outputs: list = []
        self.chain.single(t, u, outputs)
        return single_kept(outputs)

    def gather(self, us: Tensor, kept: list[Kept]) -> list:
        return self.chain.gather_values(us, kept)

    def wants_values(self, want_params: bool) -> bool:
        """Whether `vjp` reads the op outputs (else the caller need not gather them)."""
        return True

    def vjp(self, t: Tensors, us: Tensor, ws: Tensor, dt: float, values: list | None,
            want_params: bool) -> tuple[Tensor, Tensors | None]:
        """(ws + dt (df/du)^T ws, the parameter cotangents or None), from `values` as
        `gather` gives them."""
        du, dp = self.chain.vjp(t, us, ws, True, want_params, values)
        return torch.add(ws, du, alpha=dt), dp

    def vjp_single_into(self, layer: int, t: Tensors, w: Tensor, dt: float, out: Tensor,
                        g: Tensor | None, kept: Kept) -> None:
        outputs, k = kept
        add_step(out, w, self.chain.single_vjp(t, w, [v[k] for v in outputs]), dt, g)

    def record_single_into(self, layer: int, t: Tensors, u: Tensor, w: Tensor, dt: float,
                           out: Tensor, g: Tensor | None, kept: Callable[[], Kept]
                           ) -> Tensors | None:
        """`vjp_single_into` that also returns the layer's parameter cotangents as a batch
        of one (`kept()` gives the op outputs at u), or None, having done nothing, where this
        strategy has no single-layer path for them (the caller then takes a batch of one)."""
        return None


def _dense_names(chain: Chain) -> tuple[str, str] | None:
    """The weight and bias names of a chain that is exactly Linear(d, d) with bias -> Tanh."""
    ops = chain.ops
    if (len(ops) == 2 and isinstance(ops[0], _Linear) and ops[0].bias is not None
            and isinstance(ops[1], _Activation) and type(ops[1].module) is nn.Tanh):
        return ops[0].weight, ops[0].bias
    return None


class NativeDenseSteps(ChainSteps):
    """The residual step of `Linear(d, d) -> Tanh` layers on the native CPU kernels
    (`mgrit.kernels.dense.NativeDense`): one C call per step or small batch where torch
    takes four or five. Where the kernels' tanh is scalar (no libmvec), batches of more
    than DENSE_NATIVE_MAX_BATCH values go to torch, whose vectorised tanh and batched
    products win there (`NativeDense.max_batch`)."""

    skips_zeros = True

    def __init__(self, chain: Chain, kernels: NativeDense) -> None:
        super().__init__(chain)
        self.kernels = kernels
        self.weight, self.bias = _dense_names(chain)
        self._kept_outputs: dict[tuple, list] = {}

    def _kept(self, key: tuple, like: Tensor, single: bool) -> list:
        """The tensors that kept op outputs of `key` (a layer, or a batch of layers) are
        written into, the same in every pass: the adjoint's compiled phases read them by
        address, and need not be compiled again while they stay."""
        kept = self._kept_outputs.get(key)
        if kept is None or kept[2] != like.shape:
            y = torch.empty_like(like)
            kept = self._kept_outputs[key] = ([[y], [y]] if single else [y, y]) + [like.shape]
        return kept

    def step_into(self, layer: int, t: Tensors, u: Tensor, dt: float, out: Tensor,
                  g: Tensor | None, keep: bool) -> Kept | None:
        kept = self._kept(("one", layer), u, True) if keep else None
        y = None if kept is None else kept[1][0]
        if self.kernels.step(u, t[self.weight], t[self.bias], dt, out, g, y):
            # the adjoint reads the tanh alone
            return None if kept is None else (kept[:2], 0)
        return super().step_into(layer, t, u, dt, out, g, keep)

    def batch(self, t: Tensors, states: Tensor, dt: float) -> Tensor:
        if states.numel() > self.kernels.max_batch:
            return super().batch(t, states, dt)
        out = torch.empty_like(states)
        self.batch_into(t, states, dt, out, None, False)
        return out

    def batch_into(self, t: Tensors, states: Tensor, dt: float, out: Tensor, g: Tensor | None,
                   keep: bool) -> list | None:
        if states.numel() <= self.kernels.max_batch:
            weight = t[self.weight]
            kept = (self._kept(("batch", weight.data_ptr(), weight.stride(0), len(states)),
                               states, False) if keep else None)
            y = None if kept is None else kept[1]
            if self.kernels.step_batch(states, weight, t[self.bias], dt, out, g, y):
                return None if kept is None else kept[:2]
        return super().batch_into(t, states, dt, out, g, keep)

    def program_parallel(self, values: int, adjoint: bool) -> int:
        """The most independent steps of states of `values` values that a compiled phase
        takes. Forward: what a batched native call takes (`NativeDense.max_batch`), past
        which torch's vectorised tanh beats a scalar one, in a batch and in a phase
        alike; no limit where the kernels have glibc's vector tanh. Adjoint: any number,
        as the adjoint needs no tanh and a compiled phase saves every sub-step's calls."""
        limit = self.kernels.max_batch
        if adjoint or limit == math.inf:
            return sys.maxsize
        return max(1, int(limit) // max(values, 1))

    def program(self, tensors: list[Tensors], rows: list[tuple[Tensor, Tensor, Tensor | None]],
                dt: float) -> DenseProgram | None:
        """The steps out = g + u + dt f(u) for (u, out, g) in `rows`, layer `tensors[i]`,
        in order, as one native call (None where the kernels do not suit)."""
        return self.kernels.program([(u, t[self.weight], t[self.bias], g, out)
                                     for t, (u, out, g) in zip(tensors, rows)], dt, False)

    def keep_program(self, layers: list[int], tensors: list[Tensors],
                     rows: list[tuple[Tensor, Tensor, Tensor | None]], dt: float
                     ) -> tuple[DenseProgram, dict[int, Kept]] | None:
        """`program` for steps that keep their op outputs (the forward's final sweep):
        the program, and the kept outputs of each of `layers` as `step_into` gives them,
        written by every run into this strategy's tensors for those layers."""
        kept = [self._kept(("one", n), u, True) for n, (u, _, _) in zip(layers, rows)]
        program = self.kernels.program(
            [(u, t[self.weight], t[self.bias], g, out, k[1][0])
             for t, (u, out, g), k in zip(tensors, rows, kept)], dt, False)
        if program is None:
            return None
        return program, {n: (k[:2], 0) for n, k in zip(layers, kept)}

    def vjp_program(self, tensors: list[Tensors], ys: list[Tensor],
                    rows: list[tuple[Tensor, Tensor, Tensor | None]], dt: float,
                    record: tuple[list[Tensor], Tensors, Sequence[int]] | None = None
                    ) -> DenseProgram | None:
        """The adjoint steps out = g + w + dt (df/du)^T w for (w, out, g) in `rows`, with
        the tanh `ys[i]` the forward step kept, in order, as one native call. With
        `record` = (forward states, cotangents, order), step i also writes its parameter
        cotangents (not scaled by dt) into row order[i] of the weight's and the bias's."""
        if record is None:
            return self.kernels.program([(t[self.weight], w, y, g, out)
                                         for t, y, (w, out, g) in zip(tensors, ys, rows)],
                                        dt, True)
        xs, cotangents, order = record
        gw, gb = cotangents[self.weight], cotangents[self.bias]
        return self.kernels.program(
            [(t[self.weight], w, y, g, out, x, gw[r], gb[r])
             for t, y, (w, out, g), x, r in zip(tensors, ys, rows, xs, order)], dt, True)

    def phase_values(self, kept: Kept) -> tuple[Tensor, object]:
        """The kept tanh (the second op's outputs: the adjoint reads nothing else) and the
        tensor or list it sits in."""
        outputs, k = kept
        return outputs[1][k], outputs[1]

    def phase_cotangents(self, t: Tensors, count: int) -> Tensors:
        w, b = t[self.weight], t[self.bias]
        return {self.weight: w.new_empty((count, *w.shape)),
                self.bias: b.new_empty((count, *b.shape))}

    def single_values(self, layer: int, t: Tensors, u: Tensor) -> Kept:
        y = torch.empty_like(u)
        if self.kernels.step(u, t[self.weight], t[self.bias], 0.0, torch.empty_like(u), None, y):
            return [[y], [y]], 0
        return super().single_values(layer, t, u)

    def batch_values(self, t: Tensors, us: Tensor, into: list | None = None) -> list | None:
        """`values` from the native batched step, row for row the tanh that the native
        single step keeps, written into `into` (what an earlier call returned, for the
        same shapes) where given; None where the batch is past what it takes."""
        if us.numel() > self.kernels.max_batch:
            return None
        y = into[1] if into is not None else torch.empty_like(us)
        if self.kernels.step_batch(us, t[self.weight], t[self.bias], 0.0, torch.empty_like(us),
                                   None, y):
            return into if into is not None else [y, y]
        return None

    def vjp(self, t: Tensors, us: Tensor, ws: Tensor, dt: float, values: list,
            want_params: bool) -> tuple[Tensor, Tensors | None]:
        """In C, entries of zero cotangents included (they give zero cotangents and read
        nothing else); torch's kernels where the layout does not suit."""
        out = torch.empty_like(ws)
        w = t[self.weight]
        gw = torch.empty(w.shape, dtype=w.dtype) if want_params else None
        gb = torch.empty(w.shape[:2], dtype=w.dtype) if want_params else None
        if self.kernels.vjp(w, ws, values[2], dt, out, None, us if want_params else None,
                            gw, gb):
            return out, ({self.weight: gw, self.bias: gb} if want_params else None)
        return super().vjp(t, us, ws, dt, values, want_params)

    def vjp_single_into(self, layer: int, t: Tensors, w: Tensor, dt: float, out: Tensor,
                        g: Tensor | None, kept: Kept) -> None:
        outputs, k = kept
        if not self.kernels.vjp_single(t[self.weight], w, outputs[1][k], dt, out, g):
            super().vjp_single_into(layer, t, w, dt, out, g, kept)

    def record_single_into(self, layer: int, t: Tensors, u: Tensor, w: Tensor, dt: float,
                           out: Tensor, g: Tensor | None, kept: Callable[[], Kept]
                           ) -> Tensors | None:
        outputs, k = kept()
        weight = t[self.weight]
        gw = torch.empty((1, *weight.shape), dtype=weight.dtype)
        gb = torch.empty((1, weight.shape[0]), dtype=weight.dtype)
        if not self.kernels.vjp(weight[None], w[None], outputs[1][k][None], dt, out[None],
                                None if g is None else g[None], u[None], gw, gb):
            return None
        return {self.weight: gw, self.bias: gb}


class TorchDenseSteps(NativeDenseSteps):
    """`NativeDenseSteps` on torch's kernels (`TorchDense`): where torch's kernels run, the
    single steps, the kept tanh in the same tensors pass after pass and the compiled
    relaxation phases of `Linear(d, d) -> Tanh` layers, each phase one planned loop of out=
    calls (`TorchProgram`) that a recorded cycle replays. Batches and batched adjoints are
    `ChainSteps`'s."""

    skips_zeros = False
    # batches, batched adjoints and a single layer's parameter cotangents are ChainSteps's
    batch = ChainSteps.batch
    batch_into = ChainSteps.batch_into
    vjp = ChainSteps.vjp
    record_single_into = ChainSteps.record_single_into

    def __init__(self, chain: Chain, kernels: TorchDense) -> None:
        super().__init__(chain, kernels)     # type: ignore[arg-type]

    def batch_values(self, t: Tensors, us: Tensor, into: list | None = None) -> None:
        """None: a batch's values are `ChainSteps.values`'s, as its batches are (the native
        batched step that `NativeDenseSteps` takes them from is not one of torch's)."""
        return None

    def program_parallel(self, values: int, adjoint: bool) -> int:
        """Phases of at most `TorchDense.max_phase` values of independent steps, forward
        and adjoint alike: a larger one is fewer calls as `ChainSteps`'s batches."""
        return max(1, self.kernels.max_phase // max(values, 1))


class CudaDenseSteps(ChainSteps):
    """The batched residual step of `Linear(d, d) -> Tanh` layers and its adjoint on the
    CUDA kernels (`mgrit.kernels.cuda`); single steps, kept outputs and parameter
    cotangents on torch's kernels."""

    def __init__(self, chain: Chain) -> None:
        super().__init__(chain)
        self.weight, self.bias = _dense_names(chain)

    def batch(self, t: Tensors, states: Tensor, dt: float) -> Tensor:
        from .cuda import dense_step

        flat = states.reshape(len(states), -1, states.shape[-1])
        return dense_step(flat, t[self.weight], t[self.bias], dt).reshape(states.shape)

    def batch_into(self, t: Tensors, states: Tensor, dt: float, out: Tensor, g: Tensor | None,
                   keep: bool) -> list | None:
        """Nothing kept: the adjoint computes the outputs it needs at their first use."""
        value = self.batch(t, states, dt)
        if g is None:
            out.copy_(value)
        else:
            torch.add(g, value, out=out)
        return None

    def vjp(self, t: Tensors, us: Tensor, ws: Tensor, dt: float, values: list | None,
            want_params: bool) -> tuple[Tensor, Tensors | None]:
        if want_params:
            return super().vjp(t, us, ws, dt, values, want_params)
        from .cuda import dense_step_vjp

        shape = (len(ws), -1, ws.shape[-1])
        return dense_step_vjp(us.reshape(shape), t[self.weight], t[self.bias],
                              ws.reshape(shape), dt).reshape(ws.shape), None

    def wants_values(self, want_params: bool) -> bool:
        return want_params


def is_dense_tanh(module: nn.Module) -> bool:
    """Whether a step module is Linear(d, d) with bias, then Tanh: the step that the native
    and CUDA dense kernels compute."""
    chain = Chain.of(module)
    return chain is not None and _dense_names(chain) is not None


def chain_steps(chain: Chain, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                backend: str) -> ChainSteps:
    """The strategy for a chain's layers and states of this shape, dtype and device under
    the resolved kernels choice `backend` (`mgrit.kernels.choice.native_backend`): the
    CUDA dense kernels for Linear -> Tanh layers on a GPU where they load; the native dense
    kernels on a CPU for float32/float64 states of at most DENSE_NATIVE_MAX_VALUES values,
    where native kernels are allowed and build here, else the same steps on torch's
    kernels (`TorchDenseSteps`) unless `backend` is "torch-steps" (their twin); torch's
    chain kernels otherwise. Convolutions follow the same choice."""
    allowed = native_allowed(backend)
    chain = chain.allowing_native(allowed)
    if _dense_names(chain) is None:
        return ChainSteps(chain)
    if device.type == "cuda":
        from . import cuda

        return CudaDenseSteps(chain) if cuda.available() else ChainSteps(chain)
    width = shape[-1] if len(shape) else 0
    small = (device.type == "cpu" and dtype in native.SUFFIX
             and shape.numel() <= DENSE_NATIVE_MAX_VALUES and width <= native.MAX_WIDTH)
    if small and allowed and native.available():
        return NativeDenseSteps(chain, NativeDense(dtype, width))
    if small and backend != "torch-steps" and len(shape) >= 1:
        return TorchDenseSteps(chain, TorchDense(dtype, width))
    return ChainSteps(chain)
