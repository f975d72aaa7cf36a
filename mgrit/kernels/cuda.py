"""Hand-written CUDA kernels for the dense residual step, and their pure-torch twins.

For B intervals at once (MGRIT relaxation advances all intervals of a level together), each
interval i with its own layer W[i] (d, d) and b[i] (d) and states u[i] (S, d):

    dense_step:      u[i] + dt * tanh(u[i] W[i]^T + b[i])
    dense_step_vjp:  g[i] + dt * ((1 - y[i]^2) * g[i]) W[i],  y[i] = tanh(u[i] W[i]^T + b[i])

the forward step of a `Linear -> Tanh` ResNet layer and its adjoint step. The kernels
(`cuda/residual_dense.cu`, beside the package) take CUDA tensors and run on the current
stream; the library is compiled with nvcc on first use by `mgrit.kernels.build`, into the
same cache as the C kernels and keyed the same way. The `_reference` twins are plain torch
and run anywhere; tests compare the kernels against them on a GPU. This module imports on
any machine; `available()` says whether the kernels can run.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from .build import CUDA, SUFFIX, LazyLibrary, built

__all__ = ["available", "library", "dense_step", "dense_step_vjp", "dense_step_reference",
           "dense_step_vjp_reference"]

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_SIGNATURES = {
    "dense_step": [_P] * 4 + [_I] * 6 + [_D, _P],
    "dense_step_vjp": [_P] * 5 + [_I] * 7 + [_D, _P],
}


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(built(CUDA)))
    for kind, argtypes in _SIGNATURES.items():
        for suffix in SUFFIX.values():
            fn = getattr(lib, f"mgrit_{kind}_{suffix}")
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
    lib.mgrit_dense_max_width.argtypes, lib.mgrit_dense_max_width.restype = [ctypes.c_int], _I
    lib.mgrit_cuda_error_string.argtypes = [ctypes.c_int]
    lib.mgrit_cuda_error_string.restype = ctypes.c_char_p
    return lib


_library = LazyLibrary("mgrit CUDA kernels", lambda: _load())


def library() -> ctypes.CDLL:
    """The kernel library, compiled first if the cache has none for these sources, nvcc,
    flags and GPUs. A failure (no nvcc, compile error) is raised again on later calls
    without another attempt."""
    return _library.get()


def available() -> bool:
    """Whether the kernels can run here: a CUDA device and a loadable library."""
    if not torch.cuda.is_available():
        return False
    try:
        library()
    except RuntimeError:
        return False
    return True


def _shape_checked(name: str, **tensors: Tensor) -> tuple[int, int, int]:
    """(B, S, d) after checking the arguments of kernel `name`; u comes first."""
    for key, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: {key} must be a torch.Tensor, got {type(t).__name__}")
    u = tensors["u"]
    if u.dtype not in SUFFIX:
        raise TypeError(f"{name}: dtype {u.dtype} is not supported; use torch.float32 or "
                        "torch.float64")
    if u.dim() != 3:
        raise ValueError(f"{name}: u must have shape (B, S, d), got {tuple(u.shape)}")
    B, S, d = u.shape
    expected = {"u": (B, S, d), "W": (B, d, d), "b": (B, d), "g": (B, S, d)}
    for key, t in tensors.items():
        if t.device != u.device:
            raise ValueError(f"{name}: {key} is on {t.device}, u on {u.device}")
        if t.dtype != u.dtype:
            raise TypeError(f"{name}: {key} has dtype {t.dtype}, u has {u.dtype}")
        if tuple(t.shape) != expected[key]:
            raise ValueError(f"{name}: {key} must have shape {expected[key]} for u of shape "
                             f"{(B, S, d)}, got {tuple(t.shape)}")
        if B and not t[0].is_contiguous():
            raise ValueError(f"{name}: {key} must be contiguous within each interval (any "
                             f"stride between intervals), got strides {t.stride()}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors.values()):
        raise RuntimeError(f"{name} records no autograd graph; call it under torch.no_grad() "
                           "or on detached tensors")
    if u.device.type != "cuda":
        raise ValueError(f"{name}: the tensors are on {u.device}, the kernels need CUDA "
                         f"tensors (use {name}_reference on other devices)")
    return B, S, d


def _launch(name: str, tensors: dict[str, Tensor], dt: float) -> Tensor:
    B, S, d = _shape_checked(name, **tensors)
    u = tensors["u"]
    lib = library()
    limit = lib.mgrit_dense_max_width(u.element_size())
    if d > limit:
        raise ValueError(f"{name}: width d = {d} exceeds the kernels' limit of {limit} for "
                         f"{u.dtype}")
    out = torch.empty((B, S, d), dtype=u.dtype, device=u.device)
    fn = getattr(lib, f"mgrit_{name}_{SUFFIX[u.dtype]}")
    ptrs = [t.data_ptr() for t in tensors.values()]
    strides = [t.stride(0) for t in tensors.values()]
    with torch.cuda.device(u.device):
        stream = torch.cuda.current_stream(u.device).cuda_stream
        code = fn(*ptrs, out.data_ptr(), B, S, d, *strides, float(dt), stream)
    if code != 0:
        reason = lib.mgrit_cuda_error_string(code).decode()
        raise RuntimeError(f"{name} failed with CUDA error {code} ({reason}) for B={B}, "
                           f"S={S}, d={d}, {u.dtype} on {u.device}")
    return out


def dense_step(u: Tensor, W: Tensor, b: Tensor, dt: float) -> Tensor:
    """u[i] + dt * tanh(u[i] W[i]^T + b[i]) for every interval i, by the CUDA kernel.

    u (B, S, d), W (B, d, d), b (B, d): CUDA tensors on one device, all float32 or all
    float64, each contiguous within an interval (the stride between intervals is free, so
    strided views of stacked layers need no copy). Records no autograd graph.
    """
    return _launch("dense_step", {"u": u, "W": W, "b": b}, dt)


def dense_step_vjp(u: Tensor, W: Tensor, b: Tensor, g: Tensor, dt: float) -> Tensor:
    """g[i] + dt * (d/du tanh(u[i] W[i]^T + b[i]))^T g[i] for every interval i: the adjoint
    step, by the CUDA kernel. g (B, S, d); otherwise as `dense_step`."""
    return _launch("dense_step_vjp", {"u": u, "W": W, "b": b, "g": g}, dt)


def _activation(u: Tensor, W: Tensor, b: Tensor) -> Tensor:
    return torch.tanh(torch.baddbmm(b[:, None, :], u, W.transpose(1, 2)))


def dense_step_reference(u: Tensor, W: Tensor, b: Tensor, dt: float) -> Tensor:
    """`dense_step` in plain torch ops, on any device."""
    return u + dt * _activation(u, W, b)


def dense_step_vjp_reference(u: Tensor, W: Tensor, b: Tensor, g: Tensor, dt: float) -> Tensor:
    """`dense_step_vjp` in plain torch ops, on any device."""
    y = _activation(u, W, b)
    return g + dt * torch.bmm((1 - y * y) * g, W)
