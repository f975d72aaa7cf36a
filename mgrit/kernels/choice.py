"""Whether mgrit's native CPU kernels may run, and which of two kernels computes an
operation on given shapes."""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

from . import native

# (operation, dtype, torch's thread count, operand shapes) -> whether the native kernel
# computes it
_NATIVE_CHOICE: dict[tuple, bool] = {}
# the kernels a network may compute with (`LayerParallel(kernels=...)`, or MGRIT_NATIVE)
KERNELS = ("auto", "kernels", "torch", "torch-steps")


def check_kernels(kernels: str | None) -> str | None:
    """`kernels` if it names a choice of KERNELS (None: the environment's default),
    else ValueError naming the allowed ones."""
    if kernels is not None and kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}: expected one of {', '.join(KERNELS)} "
                         "(or None for MGRIT_NATIVE's choice)")
    return kernels


def native_backend(kernels: str | None = None) -> str:
    """The kernels a solve computes with: `kernels` (a choice of KERNELS), or where it is
    None the environment variable MGRIT_NATIVE (the user-facing default, read here and
    nowhere else), else "auto".

    "auto": native convolutions where they are measured faster, native dense tanh steps
    for narrow layers, and relaxation phases of such steps compiled into one native call
    each; "kernels": the same kernels, called step by step or batch by batch from Python
    (the twin that the compiled phases are tested against); "torch": torch's kernels only,
    relaxation phases of narrow dense tanh steps then planned loops of torch's calls
    (`TorchDenseSteps`); "torch-steps": torch's kernels step by step (`ChainSteps`, the
    twin of those planned phases). torch.use_deterministic_algorithms(True) makes "auto"
    and "kernels" "torch": a choice made by timing can differ between runs, and torch's
    results are what a serial run computes."""
    if kernels is None:
        kernels = os.environ.get("MGRIT_NATIVE", "auto")
        if kernels not in KERNELS:
            raise ValueError(f"MGRIT_NATIVE={kernels!r}: expected one of {', '.join(KERNELS)}")
    else:
        check_kernels(kernels)
    if kernels in ("auto", "kernels") and torch.are_deterministic_algorithms_enabled():
        return "torch"
    return kernels


def native_allowed(backend: str) -> bool:
    """Whether a resolved choice (`native_backend`) lets mgrit's native kernels run."""
    return backend in ("auto", "kernels")


def compiled_phases(backend: str) -> bool:
    """Whether relaxation phases of dense tanh steps run as one compiled call each, native
    or planned on torch's kernels ("auto" and "torch"), rather than step by step (their
    twins "kernels" and "torch-steps")."""
    return backend in ("auto", "torch")


def _native_chosen(name: str, fns: tuple[Callable, Callable], operands: tuple,
                   allowed: bool | None = None) -> bool:
    """Whether to compute operation `name` on these operands (tensors or None) with the
    native kernel fns[0] rather than torch's fns[1], where native kernels are `allowed`
    (None: as `native_backend()` has it). The first call for a set of shapes
    times both on random operands of those shapes and keeps the native kernel where it is
    at least 1.2x faster: on a CPU torch's convolutions are slow for narrow layers and fast
    for wide ones (docs/performance.md has the figures). The choice holds for torch's
    thread count at the time (the native kernel runs on one thread, torch's on all it may
    use) and is made again for another count. Operands that autograd tracks always go to
    torch."""
    x = operands[0]
    if (x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64)
            or not (native_allowed(native_backend()) if allowed is None else allowed)):
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in operands):
        return False             # the native kernels record no autograd graph
    key = (name, x.dtype, torch.get_num_threads(),
           *(None if t is None else tuple(t.shape) for t in operands))
    chosen = _NATIVE_CHOICE.get(key)
    if chosen is None:
        chosen = _NATIVE_CHOICE[key] = native.available() and _native_faster(fns, operands)
    return chosen


def _native_faster(fns: tuple[Callable, Callable], operands: tuple) -> bool:
    gen = torch.Generator().manual_seed(0)
    args = [None if t is None else torch.randn(t.shape, generator=gen, dtype=t.dtype)
            for t in operands]
    best = [float("inf"), float("inf")]
    with torch.no_grad():
        for round in range(4):   # alternated, best of three after a warm-up round
            for i, fn in enumerate(fns):
                start = time.perf_counter()
                fn(*args)
                if round:
                    best[i] = min(best[i], time.perf_counter() - start)
    return best[0] * 1.2 <= best[1]
