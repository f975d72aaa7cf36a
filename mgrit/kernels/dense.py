"""The native kernels of a `Linear(d, d) -> Tanh` residual step and its adjoint."""

from __future__ import annotations

import ctypes
import math
from typing import Callable, Sequence

import torch
from torch import Tensor

from . import native

# the most values per layer (rows of states times width) for which the native dense kernels
# run: there a step is mostly call overhead, which one C call removes; for wider states
# (W2b's batch of 32 at width 32) torch's matrix products are as fast or faster
DENSE_NATIVE_MAX_VALUES = 256
# the most values (layers times values per layer) of a batch of forward steps for which the
# native kernel runs where its tanh is the C library's scalar one: past a few layers torch's
# vectorised one and batched products win (docs/performance.md, "Native CPU kernels", has
# the timings that set both limits). With glibc's vector tanh (`native.vector_tanh`) the
# native kernel wins at every size and there is no limit.
DENSE_NATIVE_MAX_BATCH = 256


class NativeDense:
    """The residual step u + dt tanh(u W^T + b) of a `Linear(d, d) -> Tanh` layer and its
    adjoint on `mgrit.kernels.native`'s fused kernels (CPU, float32/float64): one C call per step
    or batch of layers where torch takes four or five (`mgrit.kernels.strategies.chain_steps`
    decides where they run). Its calls return False, having done nothing, where an operand's
    layout does not suit them (the caller then computes with torch). No autograd graph is
    recorded: the callers pass detached tensors. A width above the kernels' limit
    (native.MAX_WIDTH) is refused here: the C code refuses it too, with a return code that
    these calls do not read."""

    def __init__(self, dtype: torch.dtype, width: int) -> None:
        if width > native.MAX_WIDTH:
            raise ValueError(f"NativeDense: width {width} is above the kernels' limit of "
                             f"{native.MAX_WIDTH}")
        lib = native.library()
        suffix = native.SUFFIX[dtype]
        self._step = getattr(lib, f"mgrit_dense_tanh_{suffix}")
        self._vjp = getattr(lib, f"mgrit_dense_tanh_vjp_{suffix}")
        self._step_one = getattr(lib, f"mgrit_dense_tanh_one_{suffix}")
        self._vjp_one = getattr(lib, f"mgrit_dense_tanh_vjp_one_{suffix}")
        self._programs = {"step": getattr(lib, f"mgrit_dense_tanh_program_{suffix}"),
                          "keep": getattr(lib, f"mgrit_dense_tanh_keep_program_{suffix}"),
                          "adjoint": getattr(lib, f"mgrit_dense_tanh_vjp_program_{suffix}"),
                          "record": getattr(lib,
                                            f"mgrit_dense_tanh_vjp_record_program_{suffix}")}
        self._real = ctypes.c_float if dtype == torch.float32 else ctypes.c_double
        self.dtype = dtype
        # the most values of a batch of forward steps that these kernels take
        self.max_batch = math.inf if native.vector_tanh() else DENSE_NATIVE_MAX_BATCH
        self.width = width

    def step(self, u: Tensor, w: Tensor, b: Tensor, dt: float, out: Tensor,
             g: Tensor | None = None, keep: Tensor | None = None) -> bool:
        """out = g + u + dt tanh(u w^T + b) for one layer; `keep` gets the tanh."""
        if not (w.dtype == u.dtype and u.is_contiguous() and out.is_contiguous()
                and w.is_contiguous()
                and b.is_contiguous() and (g is None or g.is_contiguous())
                and (keep is None or keep.is_contiguous())):
            return False
        d = self.width
        self._step_one(u.data_ptr(), w.data_ptr(), b.data_ptr(),
                       None if g is None else g.data_ptr(), out.data_ptr(),
                       None if keep is None else keep.data_ptr(), dt, u.numel() // d, d)
        return True

    def step_batch(self, u: Tensor, w: Tensor, b: Tensor, dt: float, out: Tensor,
                   g: Tensor | None = None, keep: Tensor | None = None) -> bool:
        """`step` for a batch of layers (entries of u, w, b, ... along the first dimension,
        each contiguous, any spacing)."""
        return w.dtype == u.dtype and self._batch(self._step, u, dt, (u, w, b, g, out, keep))

    def vjp(self, w: Tensor, a: Tensor, y: Tensor, dt: float, out: Tensor | None,
            g: Tensor | None = None, x: Tensor | None = None, gw: Tensor | None = None,
            gb: Tensor | None = None) -> bool:
        """For a batch of layers: out = g + a + dt (a (1 - y^2)) w, with y the tanh that
        the forward step kept; with x (its input states) gw and gb receive the parameter
        cotangents s^T x and the sum of s's rows, s = a (1 - y^2), not scaled by dt. A
        layer whose a is all zeros (NaN not zero) gets out = g (zero without g) and zero
        cotangents; its y and x are not read."""
        return w.dtype == a.dtype and self._batch(self._vjp, a, dt, (w, a, y, g, out, x, gw, gb))

    def _batch(self, kernel: Callable[..., int], states: Tensor, dt: float, operands: tuple
               ) -> bool:
        """Call a batched kernel with each operand as (pointer, entry stride), None as (None,
        0), then dt, the layer count, rows per layer and the width; False, having called
        nothing, where an operand's entries are not contiguous."""
        args: list = []
        entry_stride = native.entry_stride
        for t in operands:
            # most operands are contiguous: their stride without a call
            stride = (0 if t is None else t.stride(0) if t.is_contiguous()
                      else entry_stride(t))
            if stride is None:
                return False
            args += (None, 0) if t is None else (t.data_ptr(), stride)
        d = self.width
        count = len(states)
        kernel(*args, dt, count, states.numel() // (count * d) if count else 0, d)
        return True

    def vjp_single(self, w: Tensor, a: Tensor, y: Tensor, dt: float, out: Tensor,
                   g: Tensor | None = None) -> bool:
        """`vjp` for one layer, without parameter cotangents (a of zeros included)."""
        if not (w.dtype == a.dtype and a.is_contiguous() and y.is_contiguous()
                and out.is_contiguous()
                and w.is_contiguous() and (g is None or g.is_contiguous())):
            return False
        d = self.width
        self._vjp_one(w.data_ptr(), a.data_ptr(), y.data_ptr(),
                      None if g is None else g.data_ptr(), out.data_ptr(), dt, a.numel() // d, d)
        return True

    def program(self, operands: Sequence[tuple[Tensor | None, ...]], dt: float, adjoint: bool
                ) -> "DenseProgram | None":
        """Steps run in the order given by one C call: per step (u, w, b, g, out) (`step`),
        (u, w, b, g, out, keep) (`step` keeping the tanh), or with `adjoint` (w, a, y, g,
        out) (`vjp_single`) or (w, a, y, g, out, x, gw, gb) (`vjp` with the parameter
        cotangents); g may be None. None where an operand's dtype, size or layout does not
        suit the kernels (the caller then takes the steps one by one)."""
        d = self.width
        if not operands or operands[0][4] is None:
            return None
        rows = operands[0][4].numel() // d
        keep = not adjoint and len(operands[0]) == 6
        record = adjoint and len(operands[0]) == 8
        sizes = ((d * d, rows * d, rows * d, rows * d, rows * d, rows * d, d * d, d) if adjoint
                 else (rows * d, d * d, d, rows * d, rows * d, rows * d))
        addresses = []
        for step in operands:
            for i, (t, size) in enumerate(zip(step, sizes)):
                if t is None:
                    if i != 3:      # only g may be left out
                        return None
                    addresses.append(0)
                    continue
                if (t.dtype != self.dtype or t.device.type != "cpu" or t.numel() != size
                        or not t.is_contiguous()):
                    return None
                addresses.append(t.data_ptr())
        if any(len(step) != len(operands[0]) for step in operands):
            return None
        ops = torch.tensor(addresses, dtype=torch.int64)
        kernel = self._programs["record" if record else "adjoint" if adjoint else
                                "keep" if keep else "step"]
        return DenseProgram(kernel, ops, len(operands), self._real(dt), rows, d, operands)


class DenseProgram:
    """A compiled relaxation phase: `count` dense tanh steps (or adjoint steps) in one C
    call. It keeps its operands alive: the call reads them by address."""

    __slots__ = ("_call", "_args", "_operands", "count", "_sizes", "_dtype", "_width")

    def __init__(self, kernel: Callable[..., int], ops: Tensor, count: int, dt: object,
                 rows: int, d: int, operands: Sequence[tuple[Tensor | None, ...]]) -> None:
        self._call = kernel
        # converted once: ctypes would convert every argument again at each call
        self._args = (ctypes.c_void_p(ops.data_ptr()), ctypes.c_int64(count), dt,
                      ctypes.c_int64(rows), ctypes.c_int64(d))
        self._operands = [ops, operands]
        self.count = count
        self._width = len(operands[0])      # operands per step: 5, or 6 with kept values
        first = next(t for t in operands[0] if t is not None)
        self._dtype = first.dtype
        self._sizes = [[None if t is None else t.numel() for t in step] for step in operands]

    def set_operand(self, index: int, tensors: Sequence[Tensor]) -> bool:
        """Read operand `index` of every step from `tensors` from now on (one per step,
        each of the size the program was built with); False, having changed nothing, where
        one does not suit the kernels."""
        for t, sizes in zip(tensors, self._sizes):
            if (t.dtype != self._dtype or t.device.type != "cpu" or t.numel() != sizes[index]
                    or not t.is_contiguous()):
                return False
        ops = self._operands[0]
        ops.view(self.count, self._width)[:, index] = torch.tensor([t.data_ptr() for t in tensors],
                                                         dtype=torch.int64)
        self._operands.append(list(tensors))     # their memory must outlive the calls
        del self._operands[2:-1]
        return True

    def __call__(self) -> None:
        self._call(*self._args)


# the most values (independent steps times values per state) of a relaxation phase that
# `TorchDense` plans into one call: past it the phase's batched products (`ChainSteps`)
# cost less than its steps' calls one by one
TORCH_DENSE_MAX_PHASE = 256


class TorchDense:
    """The calls of `NativeDense` on torch's kernels: the operations of a `ChainSteps`
    single step of a `Linear(d, d) -> Tanh` layer (`F.linear`'s addmm, tanh in place, the
    residual update) and of its single adjoint step, written into given tensors, so that a
    relaxation phase of such steps can be one planned call (`TorchProgram`) where torch's
    kernels run (MGRIT_NATIVE=torch, deterministic algorithms, no C compiler): no Python of
    the solver's per-step machinery and no allocation per step. Batches are not its own:
    `ChainSteps`'s batched products run them. A phase is planned where its independent
    steps hold at most `max_phase` values."""

    max_phase = TORCH_DENSE_MAX_PHASE

    def __init__(self, dtype: torch.dtype, width: int) -> None:
        self.dtype = dtype
        self.width = width
        self._scratch: dict[tuple, Tensor] = {}

    def scratch(self, name: str, rows: int, device: torch.device) -> Tensor:
        """A (rows, width) tensor for intermediate values, one per name and shape: a step's
        values are read before the next step writes them."""
        key = (name, rows, device)
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = torch.empty((rows, self.width), dtype=self.dtype,
                                                   device=device)
        return buf

    def step(self, u: Tensor, w: Tensor, b: Tensor, dt: float, out: Tensor,
             g: Tensor | None = None, keep: Tensor | None = None) -> bool:
        """out = g + u + dt tanh(u w^T + b) for one layer; `keep` gets the tanh."""
        if not _fits(self, (u, w, b, g, out, keep)):
            return False
        d = self.width
        u2 = u.view(-1, d)
        y = keep.view(-1, d) if keep is not None else self.scratch("y", len(u2), u.device)
        _forward(u2, w.t(), b, y, out.view(-1, d), None if g is None else g.view(-1, d), dt)
        return True

    def vjp_single(self, w: Tensor, a: Tensor, y: Tensor, dt: float, out: Tensor,
                   g: Tensor | None = None) -> bool:
        """out = g + a + dt (a (1 - y^2)) w for one layer."""
        if not _fits(self, (w, a, y, g, out)):
            return False
        d = self.width
        a2 = a.view(-1, d)
        rows = len(a2)
        _adjoint(w, a2, y.view(-1, d), out.view(-1, d), None if g is None else g.view(-1, d),
                 dt, self.scratch("s", rows, a.device), self.scratch("du", rows, a.device))
        return True

    def program(self, operands: Sequence[tuple[Tensor | None, ...]], dt: float, adjoint: bool
                ) -> "TorchProgram | None":
        """`NativeDense.program` on torch's kernels: the same operands per step, the same
        order; None where an operand does not suit."""
        if not operands or operands[0][4] is None:
            return None
        if any(len(step) != len(operands[0]) for step in operands):
            return None
        program = TorchProgram(self, adjoint, float(dt))
        return program if program.set_steps([list(step) for step in operands]) else None


def _fits(kernels: "TorchDense", tensors: Sequence[Tensor | None]) -> bool:
    """Whether every operand (None allowed) has the kernels' dtype and is contiguous."""
    return all(t is None or (t.dtype == kernels.dtype and t.is_contiguous()) for t in tensors)


def _cotangents(s: Tensor, x: Tensor, gw: Tensor, gb: Tensor) -> None:
    """A layer's parameter cotangents from s = a (1 - y^2) and its input x, not scaled by
    dt: s^T x and the sum of s's rows (`ChainSteps`'s batched products, layer by layer)."""
    torch.mm(s.t(), x, out=gw)
    torch.sum(s, 0, out=gb)


def _forward(u: Tensor, wt: Tensor, b: Tensor, y: Tensor, out: Tensor, g: Tensor | None,
             dt: float) -> None:
    """out = g + u + dt tanh(u wt + b), y the tanh: `ChainSteps`'s operations (F.linear on a
    matrix is this addmm), into given tensors."""
    torch.addmm(b, u, wt, out=y)
    y.tanh_()
    torch.add(u, y, alpha=dt, out=out)
    if g is not None:
        out.add_(g)


def _adjoint(w: Tensor, a: Tensor, y: Tensor, out: Tensor, g: Tensor | None, dt: float,
             s: Tensor, du: Tensor) -> None:
    """out = g + a + dt s w with s = a (1 - y^2) (left in s): `ChainSteps`'s single-layer
    adjoint, into given tensors."""
    torch.ops.aten.tanh_backward.grad_input(a, y, grad_input=s)
    torch.mm(s, w, out=du)
    torch.add(a, du, alpha=dt, out=out)
    if g is not None:
        out.add_(g)


class TorchProgram:
    """A relaxation phase of `Linear(d, d) -> Tanh` steps (or adjoint steps) on torch's
    kernels, planned once: per step the views its calls take, made at build time, and one
    loop of out= calls at every run. The operands are those of `NativeDense.program`;
    `set_operand` points one of them at other tensors, as `DenseProgram.set_operand`."""

    __slots__ = ("_kernels", "_adjoint", "_dt", "_steps", "_plan", "count")

    def __init__(self, kernels: TorchDense, adjoint: bool, dt: float) -> None:
        self._kernels, self._adjoint, self._dt = kernels, adjoint, dt
        self._steps: list[list[Tensor | None]] = []
        self._plan: list[tuple] = []
        self.count = 0

    def set_steps(self, steps: list[list[Tensor | None]]) -> bool:
        """Plan the calls for these operands; False, having changed nothing, where one
        does not suit (a dtype, a layout, a size, an operand left out but g)."""
        k = self._kernels
        d = k.width
        first = steps[0][4]
        rows = first.numel() // d
        sizes = ((d * d, rows * d, rows * d, rows * d, rows * d, rows * d, d * d, d)
                 if self._adjoint else (rows * d, d * d, d, rows * d, rows * d, rows * d))
        for step in steps:
            for i, t in enumerate(step):
                if t is None:
                    if i != 3:
                        return False
                elif (t.dtype != k.dtype or t.device != first.device or t.numel() != sizes[i]
                      or not t.is_contiguous()):
                    return False
        flat = lambda t: None if t is None else t.view(-1, d)  # noqa: E731
        plan = []
        if self._adjoint:
            s, du = k.scratch("s", rows, first.device), k.scratch("du", rows, first.device)
            for step in steps:
                w, a, y, g, out = step[:5]
                record = None
                if len(step) == 8:
                    x, gw, gb = step[5:]
                    record = (flat(x), gw.view(d, d), gb.view(d))
                plan.append((w.view(d, d), flat(a), flat(y), flat(out), flat(g), s, du,
                             record))
        else:
            scratch = k.scratch("y", rows, first.device)
            for step in steps:
                u, w, b, g, out = step[:5]
                y = flat(step[5]) if len(step) == 6 else scratch
                plan.append((flat(u), w.view(d, d).t(), b.view(d), y, flat(out), flat(g)))
        self._steps, self._plan, self.count = steps, plan, len(steps)
        return True

    def set_operand(self, index: int, tensors: Sequence[Tensor]) -> bool:
        """Read operand `index` of every step from `tensors` from now on (one per step);
        False, having changed nothing, where one does not suit. The adjoint's kept tanh
        (operand 2, new tensors at every pass where torch's batches kept them) replaces
        its views in the plan; any other operand plans the phase again."""
        steps = [list(step) for step in self._steps]
        for step, t in zip(steps, tensors):
            step[index] = t
        if not (self._adjoint and index == 2):
            return self.set_steps(steps)
        first, d = self._steps[0][2], self._kernels.width
        for t in tensors:
            if (t.dtype != first.dtype or t.device != first.device
                    or t.numel() != first.numel() or not t.is_contiguous()):
                return False
        self._plan = [(*entry[:2], t.view(-1, d), *entry[3:])
                      for entry, t in zip(self._plan, tensors)]
        self._steps = steps
        return True

    def __call__(self) -> None:
        dt = self._dt
        if not self._adjoint:
            for u, wt, b, y, out, g in self._plan:
                _forward(u, wt, b, y, out, g, dt)
            return
        for w, a, y, out, g, s, du, record in self._plan:
            _adjoint(w, a, y, out, g, dt, s, du)
            if record is not None:
                _cotangents(s, *record)
