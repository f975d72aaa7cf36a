"""The propagators of a residual network on a rank's `LayerStack`.

Forward:  Phi_n(u) = u + dt * f(u; theta_n)
Adjoint:  on the reversed grid, w -> w + dt * (df/du)(u_p; theta_p)^T w, with p the
          forward point where the corresponding forward step starts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.propagator import Step, StepBatch
from ..execute import write_result
from ..kernels.dense import DENSE_NATIVE_MAX_BATCH, NativeDense
from .stack import LayerStack, _use_cuda_kernels


def _add_step(out: Tensor, u: Tensor, f: Tensor, dt: float, g: Tensor | None) -> None:
    """out = g + u + dt * f (g None: no g), in place: a step's update written into its row."""
    torch.add(u, f, alpha=dt, out=out)
    if g is not None:
        out.add_(g)


def _per_entry(x: Tensor) -> int:
    """Values per entry of a batch (x's first dimension)."""
    return x.numel() // len(x) if len(x) else 0


def _nonzero_rows(x: Tensor) -> list[bool]:
    """Whether each entry of x (along its first dimension) holds anything but zeros; NaN
    counts as non-zero. On large entries a maximum and a minimum beat `any`, which turns
    every element into a bool first (W1's batch of 4 x 117600: 65 against 400 us); on small
    ones `any`, one call, is cheaper. The answer comes back as one list: reducing it with
    more tensor calls would cost more than the check (W2's batch of 3: 9 against 5 us)."""
    flat = x.reshape(len(x), -1)
    if flat.shape[1] < 16384:
        return flat.any(dim=1).tolist()
    return ((flat.amax(dim=1) != 0) | (flat.amin(dim=1) != 0)).tolist()


def _is_nonzero(x: Tensor) -> bool:
    """Whether one state holds anything but zeros (NaN counts): the sequential march's
    check, two calls for a small state (W2: 4 against 10 us as a batch of one)."""
    if x.numel() < 16384:
        return bool(x.any())
    return _nonzero_rows(x[None])[0]


class NetworkPropagator:
    """Phi(u) = u + dt * f(u; theta_n): the forward steps of the residual network.

    Coarse steps use the layer where they start. `batched` switches `step_batch`, one
    vmapped call per batch of intervals, on or off.
    """

    def __init__(self, stack: LayerStack, batched: bool, keep_outputs: bool = False) -> None:
        self.stack = stack
        if batched:
            self.step_batch = self._step_batch
        # With `keep_outputs`, the final fine-level sweep of every cycle keeps each layer's
        # op outputs, the values that the adjoint's fine-level VJPs would otherwise compute
        # again: the sweep's steps start from the final states, where the backward pass
        # linearises. layer -> (outputs of its batch, one entry per op; its index there)
        self.outputs: dict[int, tuple[list, int]] | None = (
            {} if keep_outputs and stack.chain is not None else None)
        self._keeping = False

    def fine_sweep(self, active: bool) -> None:
        if self.outputs is not None:
            if active:
                self.outputs.clear()
            self._keeping = active

    def graph_key(self) -> tuple[int, ...] | None:
        """For CUDA graphs of sweeps (`SweepGraphs`): the parameters' storage, or None while
        the steps keep their outputs (Python bookkeeping that a replay would skip)."""
        return None if self._keeping else self.stack.storage_key()

    def step(self, u: Tensor, s: Step) -> Tensor:
        if self.stack.chain is not None:
            return u + s.dt * self.stack.chain.single(self.stack.views(s.fine_index), u)
        return u + s.dt * self.stack.module(s.fine_index)(u)

    def step_into(self, u: Tensor, s: Step, out: Tensor, g: Tensor | None) -> None:
        """out = g + Phi(u) (g None: zero), written in place with few kernel calls: the
        sequential march takes one step at a time, where calls cost more than arithmetic."""
        if self.stack.chain is None:
            write_result(out, self.step(u, s), g)
            return
        keep = [] if self._keeping and s.level == 0 else None
        dense = self.stack.native_dense(u, u.numel())
        if dense is not None:
            t = self.stack.views(s.fine_index)
            y = None if keep is None else torch.empty_like(u)
            if dense.step(u, t["0.weight"], t["0.bias"], s.dt, out, g, y):
                if y is not None:
                    self.outputs[s.fine_index] = ([[y], [y]], 0)
                return
        f = self.stack.chain.single(self.stack.views(s.fine_index), u, keep)
        if keep is not None:
            self.outputs[s.fine_index] = ([[y] for y in keep], 0)
        _add_step(out, u, f, s.dt, g)

    def _step_batch(self, states: Tensor, steps: StepBatch) -> Tensor:
        m = steps.level_stride
        tensors = self.stack.rows(steps.start * m, steps.stride * m, steps.count)
        if _use_cuda_kernels(self.stack, states):
            from .cuda import dense_step

            flat = states.reshape(len(states), -1, states.shape[-1])
            return dense_step(flat, tensors["0.weight"], tensors["0.bias"],
                              steps.dt).reshape(states.shape)
        dense = self._native_batch(states)
        if (self._keeping and steps.level == 0) or dense is not None:
            out = torch.empty_like(states)
            self._chain_batch_into(states, steps, tensors, dense, out, None)
            return out
        return torch.add(states, self.stack.f_batch(tensors, states), alpha=steps.dt)

    def _native_batch(self, states: Tensor) -> NativeDense | None:
        """The native dense kernels for a batch small enough that they beat torch's."""
        if states.numel() > DENSE_NATIVE_MAX_BATCH:
            return None
        return self.stack.native_dense(states, _per_entry(states))

    def step_batch_into(self, states: Tensor, steps: StepBatch, out: Tensor,
                        g: Tensor | None) -> None:
        """out = g + Phi(states) for a batch (g None: zero), written layer by layer from a
        chain's outputs: no stacked temporary and no copy."""
        if self.stack.chain is None or _use_cuda_kernels(self.stack, states):
            write_result(out, self._step_batch(states, steps), g)
            return
        m = steps.level_stride
        tensors = self.stack.rows(steps.start * m, steps.stride * m, steps.count)
        self._chain_batch_into(states, steps, tensors, self._native_batch(states), out, g)

    def _chain_batch_into(self, states: Tensor, steps: StepBatch, tensors: dict[str, Tensor],
                          dense: NativeDense | None, out: Tensor, g: Tensor | None) -> None:
        """`step_batch_into` for a chain, with the batch's parameter rows and native
        kernels (or None) at hand."""
        chain = self.stack.chain
        keeping = self._keeping and steps.level == 0
        if dense is not None:
            y = torch.empty_like(states) if keeping else None
            if dense.step_batch(states, tensors["0.weight"], tensors["0.bias"], steps.dt, out,
                                g, y):
                if y is not None:
                    outputs = [y, y]        # the adjoint reads the tanh (op 1) alone
                    for n in range(steps.count):
                        self.outputs[steps.start + n * steps.stride] = (outputs, n)
                return
        if keeping:
            f, outputs = chain.forward_values(tensors, states)
            for n in range(steps.count):
                self.outputs[steps.start + n * steps.stride] = (outputs, n)
        else:
            f = chain.forward(tensors, states, stack=False)
        if isinstance(f, list):
            for i, fi in enumerate(f):
                torch.add(states[i], fi, alpha=steps.dt, out=out[i])
            if g is not None:
                out.add_(g)
        else:
            _add_step(out, states, f, steps.dt, g)


class AdjointPropagator:
    """The adjoint on the reversed grid: reversed step k of a level with stride M is the
    transposed linearisation of the forward step from point p = N - (k + 1) M over M fine
    steps, using layer p at the forward state u_p.

    While `fine_sweep(True)` is on, level-0 steps (the final fine-level sweep of the adjoint
    and its residual: one VJP per layer, with final values) also give the layer's parameter
    gradient, dt (df/dtheta)(u_p)^T w, from the same forward pass; `gradients` collects them
    batch by batch.
    """

    def __init__(self, stack: LayerStack, num_steps: int, strides: list[int], states: Tensor,
                 offset: int, batched: bool,
                 outputs: dict[int, tuple[list, int]] | None = None) -> None:
        self.stack = stack
        self.outputs = outputs      # the forward pass's kept op outputs at `states`
        self.num_steps = num_steps
        self.strides = strides
        self.states = states        # forward states: row i holds point offset + i
        self.offset = offset
        self.recording = False
        # (layers, parameter cotangents of that batch, dt), in the order they were taken;
        # a later entry for a layer replaces an earlier one
        self.gradients: list[tuple[list[int], dict[str, Tensor], float]] = []
        # (first point, stride, count) of a batch -> [its points, their forward states, the
        # chain's op outputs there (None until its first VJP)]: all fixed for a whole
        # backward solve, so gathered once
        self._gathered: dict[tuple[int, int, int], list] = {}
        # op outputs at a forward point that the forward pass did not keep, computed at their
        # first use in this backward solve (same form as `outputs`)
        self._computed: dict[int, tuple[list, int]] = {}
        if batched:
            self.step_batch = self._step_batch

    def begin(self) -> None:
        """A new backward solve: new forward states, no gradients yet."""
        self.gradients = []
        self._gathered.clear()
        self._computed.clear()

    def fine_sweep(self, active: bool) -> None:
        self.recording = active

    def _kept(self, p: int) -> tuple[list, int] | None:
        """The chain's op outputs at forward point p with layer p, where every adjoint step
        that uses layer p linearises, whatever its level: kept by the forward pass or
        computed earlier in this backward solve; None if neither."""
        kept = self.outputs.get(p) if self.outputs else None
        return kept if kept is not None else self._computed.get(p)

    def _values(self, tensors: dict[str, Tensor], us: Tensor, layers: list[int]) -> list:
        """The chain's op outputs for a batch of layers at their forward states: gathered
        from kept ones, or computed (and kept) if any layer has none."""
        chain = self.stack.chain
        kept = [self._kept(p) for p in layers]
        if any(k is None for k in kept):
            _, outputs = chain.forward_values(tensors, us)
            kept = [(outputs, i) for i in range(len(layers))]
            self._computed.update(zip(layers, kept))
        return chain.gather_values(us, kept)

    def _vjp(self, tensors: dict[str, Tensor], us: Tensor, ws: Tensor, layers: list[int],
             level: int, dt: float, batch: list | None = None) -> Tensor:
        """ws + dt (df/du)^T ws for a batch (`batch`: its entry of `_gathered`, where the op
        outputs are kept for the next call). The adjoint is linear in w, so entries whose w
        is exactly zero (much of a first cycle from a zero guess) map to zero and are
        skipped: the result is the same to the bit."""
        record = self.recording and level == 0
        if self.stack.chain is not None:
            dense = self.stack.native_dense(ws, _per_entry(ws))
            if dense is not None:
                out = self._native_vjp(dense, tensors, us, ws, layers, dt, batch, record)
                if out is not None:
                    return out
        nonzero = _nonzero_rows(ws)
        if not all(nonzero):
            out = torch.zeros_like(ws)
            if record:
                zeros = {k: torch.zeros_like(v) for k, v in tensors.items()
                         if k in self.stack.names}
                self.gradients.append((layers, zeros, dt))
            keep = [i for i, nz in enumerate(nonzero) if nz]
            if len(keep) == 1 and not record and self.stack.chain is not None:
                # a lone non-zero entry (the first cycle's front on the rank that starts the
                # backward solve) takes the single-step VJP, not a batch of one
                i = keep[0]
                torch.add(ws[i], self._single_du(layers[i], ws[i]), alpha=dt, out=out[i])
            elif keep:
                index = torch.tensor(keep, device=ws.device)
                out[index] = self._vjp({k: v.index_select(0, index) for k, v in tensors.items()},
                                       us.index_select(0, index), ws.index_select(0, index),
                                       [layers[i] for i in keep], level, dt)
            return out
        if not record and _use_cuda_kernels(self.stack, ws):
            from .cuda import dense_step_vjp

            shape = (len(ws), -1, ws.shape[-1])
            return dense_step_vjp(us.reshape(shape), tensors["0.weight"], tensors["0.bias"],
                                  ws.reshape(shape), dt).reshape(ws.shape)
        values = None
        if self.stack.chain is not None:
            values = self._batch_values(tensors, us, layers, batch)
        du, dp = self.stack.vjp_batch(tensors, us, ws, want_input=True, want_params=record,
                                      values=values)
        if record:
            self.gradients.append((layers, dp, dt))
        return torch.add(ws, du, alpha=dt)

    def _batch_values(self, tensors: dict[str, Tensor], us: Tensor, layers: list[int],
                      batch: list | None) -> list:
        """The batch's op outputs: kept in its `_gathered` entry, or gathered (and kept)."""
        values = batch[2] if batch is not None else None
        if values is None:
            values = self._values(tensors, us, layers)
            if batch is not None:
                batch[2] = values
        return values

    def _native_vjp(self, dense: NativeDense, tensors: dict[str, Tensor], us: Tensor,
                    ws: Tensor, layers: list[int], dt: float, batch: list | None, record: bool
                    ) -> Tensor | None:
        """`_vjp` on the native kernels, which skip zero entries themselves; None, having
        recorded nothing, where the operands' layout does not suit them."""
        values = self._batch_values(tensors, us, layers, batch)
        out = torch.empty_like(ws)
        w = tensors["0.weight"]
        gw = torch.empty(w.shape, dtype=w.dtype) if record else None
        gb = torch.empty(w.shape[:2], dtype=w.dtype) if record else None
        if not dense.vjp(w, ws, values[2], dt, out, None, us if record else None, gw, gb):
            return None
        if record:
            self.gradients.append((layers, {"0.weight": gw, "0.bias": gb}, dt))
        return out

    def step_into(self, w: Tensor, s: Step, out: Tensor, g: Tensor | None) -> None:
        """out = g + (this step's adjoint)(w) (g None: zero), in place; see
        NetworkPropagator.step_into."""
        if self.stack.chain is None:
            write_result(out, self.step(w, s), g)
            return
        dense = self.stack.native_dense(w, w.numel())
        p = self._layer_point(s)
        if self.recording and s.level == 0:
            if dense is None or not self._record_single(dense, p, w, s.dt, out, g):
                write_result(out, self.step(w, s), g)
            return
        if dense is not None:
            kept = self._kept(p)
            # with the forward's tanh at hand the kernel makes the zero check itself
            if kept is not None and dense.vjp_single(self.stack.views(p)["0.weight"], w,
                                                     kept[0][1][kept[1]], s.dt, out, g):
                return
        if not _is_nonzero(w):
            if g is None:
                out.zero_()
            else:
                out.copy_(g)
            return
        if dense is not None:
            views = self.stack.views(p)
            outputs, k = self._single_outputs(p, views, dense)
            if dense.vjp_single(views["0.weight"], w, outputs[1][k], s.dt, out, g):
                return
        _add_step(out, w, self._single_du(p, w), s.dt, g)

    def _record_single(self, dense: NativeDense, p: int, w: Tensor, dt: float, out: Tensor,
                       g: Tensor | None) -> bool:
        """A recorded fine step (the final sweep's march) on the native kernels: out = g +
        the step's adjoint of w, and layer p's parameter cotangents appended to
        `gradients`, in one call. False, having done nothing, where the kernels do not
        apply."""
        views = self.stack.views(p)
        weight = views["0.weight"]
        outputs, k = self._single_outputs(p, views, dense)
        gw = torch.empty((1, *weight.shape), dtype=weight.dtype)
        gb = torch.empty((1, weight.shape[0]), dtype=weight.dtype)
        u = self.states[p - self.offset]
        if not dense.vjp(weight[None], w[None], outputs[1][k][None], dt, out[None],
                         None if g is None else g[None], u[None], gw, gb):
            return False
        self.gradients.append(([p], {"0.weight": gw, "0.bias": gb}, dt))
        return True

    def _single_outputs(self, p: int, views: dict[str, Tensor], dense: NativeDense | None = None
                        ) -> tuple[list, int]:
        """The op outputs of layer p at forward state p: kept, or computed now (natively
        with `dense`) and kept."""
        kept = self._kept(p)
        if kept is not None:
            return kept
        u = self.states[p - self.offset]
        if dense is not None:
            y = torch.empty_like(u)
            if dense.step(u, views["0.weight"], views["0.bias"], 0.0, torch.empty_like(u),
                          None, y):
                kept = self._computed[p] = ([[y], [y]], 0)
                return kept
        keep: list[Tensor] = []
        self.stack.chain.single(views, u, keep)
        kept = self._computed[p] = ([[y] for y in keep], 0)
        return kept

    def _single_du(self, p: int, w: Tensor) -> Tensor:
        """(df/du)^T w for layer p at forward state p, one state, with plain calls from the
        op outputs kept for layer p (computed now, and kept, if there are none)."""
        views = self.stack.views(p)
        outputs, k = self._single_outputs(p, views)
        return self.stack.chain.single_vjp(views, w, [values[k] for values in outputs])

    def _layer_point(self, s: Step) -> int:
        """The forward point p whose layer and state step s of the adjoint uses."""
        return self.num_steps - s.fine_index - self.strides[s.level]

    def step(self, w: Tensor, s: Step) -> Tensor:
        p = self._layer_point(s)
        u = self.states[p - self.offset]
        if (self.stack.chain is not None or (self.recording and s.level == 0)
                or not _is_nonzero(w)):
            return self._vjp(self.stack.rows(p, 1, 1), u[None], w[None], [p], s.level, s.dt)[0]
        with torch.enable_grad():
            x = u.detach().requires_grad_()
            y = self.stack.module(p)(x)
            return w + s.dt * torch.autograd.grad(y, x, w)[0]

    def _step_batch(self, ws: Tensor, steps: StepBatch) -> Tensor:
        m = self.strides[steps.level]
        first = self.num_steps - steps.start * m - m
        stride = -steps.stride * m
        key = (first, stride, steps.count)
        batch = self._gathered.get(key)
        if batch is None:
            points = torch.arange(first, first + stride * steps.count, stride)
            us = self.states.index_select(0, (points - self.offset).to(self.states.device))
            batch = self._gathered[key] = [points.tolist(), us, None]
        tensors = self.stack.rows(first, stride, steps.count)
        return self._vjp(tensors, batch[1], ws, batch[0], steps.level, steps.dt, batch)
