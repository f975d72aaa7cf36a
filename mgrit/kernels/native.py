"""Hand-written C kernels for the CPU, compiled on first use with the system C compiler.

`conv2d` is a direct 'same' stride-1 convolution for narrow layers (csrc/conv2d.c), where
torch's CPU convolution is far from the arithmetic they need. `dense_tanh` and
`dense_tanh_vjp` (csrc/dense.c) are the residual step u + h tanh(u W^T + b) of a dense layer
and its adjoint over a batch of layers in one call, where torch needs four or five calls,
each costing more than a narrow layer's arithmetic (docs/performance.md has the figures).
`keep_mask` (csrc/draws.c) hashes the keep masks of mgrit's keyed dropout, bit for bit those
of `mgrit.nn.engine.randomness`, in 32-bit lanes where torch computes them in int64.
The library is built by `mgrit.kernels.build` with `$CC` (else cc, gcc or clang on PATH)
into the kernels' cache. Where no compiler works, `available()` is False and callers use
torch.
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor

from .build import C, SUFFIX, LazyLibrary, built

__all__ = ["available", "conv2d", "conv2d_weight", "dense_tanh", "dense_tanh_vjp",
           "keep_mask"]

MAX_WIDTH = 1024  # dense.c's limit on the width d


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(built(C)))
    P, I = ctypes.c_void_p, ctypes.c_int64
    for suffix in SUFFIX.values():
        fn = getattr(lib, f"mgrit_conv2d_{suffix}")
        fn.argtypes, fn.restype = [P] * 4 + [I] * 7, ctypes.c_int
        fn = getattr(lib, f"mgrit_conv2d_weight_{suffix}")
        fn.argtypes, fn.restype = [P] * 3 + [I] * 7, ctypes.c_int
        real = ctypes.c_float if suffix == "f32" else ctypes.c_double
        fn = getattr(lib, f"mgrit_dense_tanh_{suffix}")
        fn.argtypes, fn.restype = [P, I] * 6 + [real] + [I] * 3, ctypes.c_int
        fn = getattr(lib, f"mgrit_dense_tanh_vjp_{suffix}")
        fn.argtypes, fn.restype = [P, I] * 8 + [real] + [I] * 3, ctypes.c_int
        fn = getattr(lib, f"mgrit_dense_tanh_one_{suffix}")
        fn.argtypes, fn.restype = [P] * 6 + [real, I, I], ctypes.c_int
        fn = getattr(lib, f"mgrit_dense_tanh_vjp_one_{suffix}")
        fn.argtypes, fn.restype = [P] * 5 + [real, I, I], ctypes.c_int
        lib.mgrit_dense_vector_tanh.argtypes, lib.mgrit_dense_vector_tanh.restype = [], ctypes.c_int
        for name in ("mgrit_dense_tanh_program", "mgrit_dense_tanh_keep_program",
                     "mgrit_dense_tanh_vjp_program", "mgrit_dense_tanh_vjp_record_program"):
            fn = getattr(lib, f"{name}_{suffix}")
            fn.argtypes, fn.restype = [P, I, real, I, I], ctypes.c_int
    lib.mgrit_keep_mask.argtypes = [ctypes.c_uint32, I, ctypes.c_uint64, P]
    lib.mgrit_keep_mask.restype = ctypes.c_int
    return lib


_library = LazyLibrary("mgrit native kernels", lambda: _load())


def library() -> ctypes.CDLL:
    """The kernel library, built first if it is not in the cache (see LazyLibrary)."""
    return _library.get()


def vector_tanh() -> bool:
    """Whether the dense kernels' tanh is the vector one of glibc's libmvec (the build
    links it where it can, `mgrit.kernels.build`), rather than the C library's scalar one."""
    return bool(library().mgrit_dense_vector_tanh())


def available() -> bool:
    """Whether the kernels can run here (a C compiler built them, or the cache has them)."""
    try:
        library()
    except RuntimeError:
        return False
    return True


def _checked(name: str, x: Tensor, w_shape: tuple[int, ...], others: dict[str, Tensor]
             ) -> None:
    """Raise unless x (N, Ci, H, W) and a kernel of shape w_shape (Co, Ci, KH, KW) make a
    'same' convolution the kernels compute, with `others` of x's dtype on the CPU."""
    if x.dim() != 4 or len(w_shape) != 4 or x.shape[1] != w_shape[1]:
        raise ValueError(f"{name}: x must be (N, Ci, H, W) and the kernel (Co, Ci, KH, KW), "
                         f"got {tuple(x.shape)} and {tuple(w_shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"{name}: x has no input channels")
    if w_shape[2] % 2 == 0 or w_shape[3] % 2 == 0:
        raise ValueError(f"{name}: 'same' padding needs an odd kernel, got {tuple(w_shape[2:])}")
    tensors = {"x": x, **others}
    if x.dtype not in SUFFIX or any(t.dtype != x.dtype for t in tensors.values()):
        raise TypeError(f"{name}: float32 or float64 tensors of one dtype, got " + ", ".join(
            f"{k} {t.dtype}" for k, t in tensors.items()))
    if any(t.device.type != "cpu" for t in tensors.values()):
        raise ValueError(f"{name}: the tensors must be on the CPU")


def _call(name: str, x: Tensor, *args: object) -> None:
    fn = getattr(library(), f"mgrit_{name}_{SUFFIX[x.dtype]}")
    code = fn(*args)
    if code == 1:
        raise MemoryError(f"{name}: out of memory for x of shape {tuple(x.shape)}")
    if code:
        raise RuntimeError(f"{name}: the kernel refused its arguments (code {code})")


def conv2d(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """torch.nn.functional.conv2d(x, w, b, padding=(kh // 2, kw // 2)) for CPU tensors of
    float32 or float64, x of shape (N, Ci, H, W) and w (Co, Ci, KH, KW) with odd KH and KW.
    No autograd graph is recorded."""
    _checked("conv2d", x, tuple(w.shape), {"w": w} if b is None else {"w": w, "b": b})
    if b is not None and tuple(b.shape) != (w.shape[0],):
        raise ValueError(f"conv2d: b must have shape ({w.shape[0]},), got {tuple(b.shape)}")
    x, w = x.detach().contiguous(), w.detach().contiguous()
    b = None if b is None else b.detach().contiguous()
    n, ci, h, wd = x.shape
    y = torch.empty((n, w.shape[0], h, wd), dtype=x.dtype)
    if y.numel():
        _call("conv2d", x, x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(),
              y.data_ptr(), n, ci, w.shape[0], h, wd, w.shape[2], w.shape[3])
    return y


def conv2d_weight(x: Tensor, w_shape: tuple[int, ...], g: Tensor) -> Tensor:
    """The gradient of conv2d(x, w) with respect to a kernel of shape w_shape for the output
    cotangent g (N, Co, H, W): torch.nn.grad.conv2d_weight with 'same' padding."""
    _checked("conv2d_weight", x, tuple(w_shape), {"g": g})
    n, ci, h, wd = x.shape
    if tuple(g.shape) != (n, w_shape[0], h, wd):
        raise ValueError(f"conv2d_weight: g must have shape {(n, w_shape[0], h, wd)}, got "
                         f"{tuple(g.shape)}")
    x, g = x.detach().contiguous(), g.detach().contiguous()
    gw = torch.empty(tuple(w_shape), dtype=x.dtype)
    _call("conv2d_weight", x, x.data_ptr(), g.data_ptr(), gw.data_ptr(), n, ci, w_shape[0],
          h, wd, w_shape[2], w_shape[3])
    return gw


def entry_stride(t: Tensor) -> int | None:
    """The distance between t's entries along its first dimension, or None unless each
    entry is contiguous (what the dense kernels read)."""
    if t.is_contiguous():
        return t.stride(0)
    shape, strides = t.shape, t.stride()
    expect = 1
    for i in range(len(shape) - 1, 0, -1):
        if shape[i] != 1 and strides[i] != expect:
            return None
        expect *= shape[i]
    return strides[0]


def _entries(name: str, what: str, t: Tensor, count: int | None, shape: tuple[int, ...],
             dtype: torch.dtype) -> int:
    """The stride between t's entries (0 for one layer, count None), after checking that t
    holds `count` entries of `shape` with each entry contiguous, of `dtype`, on the CPU."""
    full = shape if count is None else (count, *shape)
    if tuple(t.shape) != full:
        raise ValueError(f"{name}: {what} must have shape {full}, got {tuple(t.shape)}")
    if t.dtype != dtype or not t.is_cpu:
        raise TypeError(f"{name}: {what} must be a CPU tensor of {dtype}, got {t.dtype} on "
                        f"{t.device}")
    if count is None:
        if not t.is_contiguous():
            raise ValueError(f"{name}: {what} must be contiguous")
        return 0
    stride = entry_stride(t)
    if stride is None:
        raise ValueError(f"{name}: each entry of {what} must be contiguous, got strides "
                         f"{t.stride()}")
    return stride


def _pointers(name: str, count: int | None, dtype: torch.dtype,
              operands: tuple[tuple[str, Tensor | None, tuple[int, ...]], ...]) -> list:
    """(pointer, entry stride) per operand (what, tensor or None, one entry's shape),
    flattened, each checked by `_entries`; (None, 0) for a missing one."""
    args: list = []
    for what, t, shape in operands:
        args += [None, 0] if t is None else [t.data_ptr(),
                                            _entries(name, what, t, count, shape, dtype)]
    return args


def _dense_layout(name: str, w: Tensor, u: Tensor) -> tuple[int | None, tuple[int, ...], int]:
    """(count, or None for one layer; one entry's state shape; rows) of a dense call."""
    if w.dim() not in (2, 3) or w.shape[-1] != w.shape[-2]:
        raise ValueError(f"{name}: w must be (d, d) or (count, d, d), got {tuple(w.shape)}")
    if w.dtype not in SUFFIX:
        raise TypeError(f"{name}: float32 or float64 tensors, got w of {w.dtype}")
    count = None if w.dim() == 2 else w.shape[0]
    d = w.shape[-1]
    state = tuple(u.shape) if count is None else tuple(u.shape[1:])
    if not state or state[-1] != d or (count is not None and u.dim() < 2):
        raise ValueError(f"{name}: states must be (..., {d})" + ("" if count is None else
                         f" with a leading dimension of {count}") + f", got {tuple(u.shape)}")
    if d > MAX_WIDTH:
        raise ValueError(f"{name}: width {d} is above the kernels' limit of {MAX_WIDTH}")
    return count, state, math.prod(state) // d if d else 0


def dense_tanh(u: Tensor, w: Tensor, b: Tensor | None, dt: float, out: Tensor,
               g: Tensor | None = None, keep: Tensor | None = None) -> None:
    """out = g + u + dt * tanh(u w^T + b), in place, for one layer (w of shape (d, d), u of
    (..., d)) or a batch of layers (w (count, d, d), u (count, ..., d)); b, g and keep may
    be None. `keep` receives tanh(u w^T + b). Every entry (a layer's part of a tensor) must
    be contiguous; entries may lie any fixed distance apart (strided views of stacked
    layers). out may be u itself. float32 or float64 CPU tensors; no autograd graph."""
    name = "dense_tanh"
    count, state, rows = _dense_layout(name, w, u)
    d = w.shape[-1]
    args = _pointers(name, count, w.dtype, (
        ("u", u, state), ("w", w, (d, d)), ("b", b, (d,)), ("g", g, state), ("out", out, state),
        ("keep", keep, state)))
    if u.numel():
        _call(name, u, *args, dt, 1 if count is None else count, rows, d)


def dense_tanh_vjp(w: Tensor, a: Tensor, y: Tensor, dt: float, out: Tensor | None,
                   g: Tensor | None = None, x: Tensor | None = None,
                   grads: tuple[Tensor, Tensor | None] | None = None) -> None:
    """The adjoint of `dense_tanh`'s step at the states x where it kept y: out = g + a +
    dt * (a * (1 - y^2)) w, in place, for one layer or a batch (shapes as in dense_tanh;
    out may be a itself, or None for the parameters alone). With `grads` = (gw, gb) (gb may
    be None) and x, also the parameter cotangents, not scaled by dt: gw = s^T x over the
    rows of each layer's states and gb = the sum of s's rows, s = a * (1 - y^2). A layer
    whose a is all zeros (NaN is not zero) gets out = g (zero without g) and zero
    cotangents without its y and x being read: the adjoint is linear in a."""
    name = "dense_tanh_vjp"
    count, state, rows = _dense_layout(name, w, a)
    d = w.shape[-1]
    gw, gb = grads if grads is not None else (None, None)
    if (x is None) != (grads is None):
        raise ValueError(f"{name}: the parameter cotangents need x and grads together")
    args = _pointers(name, count, w.dtype, (
        ("w", w, (d, d)), ("a", a, state), ("y", y, state), ("g", g, state), ("out", out, state),
        ("x", x, state), ("gw", gw, (d, d)), ("gb", gb, (d,))))
    if a.numel() or gw is not None:
        _call(name, a, *args, dt, 1 if count is None else count, rows, d)


def keep_mask(key: int, shape: tuple[int, ...], threshold: int) -> Tensor:
    """A bool CPU tensor of `shape`: element i (flat index) is True where the keyed
    dropout's hash of (i, `key`) is at least `threshold` (at most 2**32); `key` is the
    draw's mixed key and site, below 2**32 (`mgrit.nn.engine.randomness`)."""
    if not 0 <= key < 1 << 32 or not 0 <= threshold <= 1 << 32:
        raise ValueError(f"keep_mask: key must be below 2**32 and threshold at most 2**32, "
                         f"got {key} and {threshold}")
    out = torch.empty(shape, dtype=torch.bool)
    if out.numel():
        code = library().mgrit_keep_mask(key, out.numel(), threshold, out.data_ptr())
        if code:
            raise RuntimeError(f"keep_mask: the kernel refused its arguments (code {code})")
    return out
