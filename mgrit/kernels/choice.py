"""Whether mgrit's native CPU kernels may run, and which of two kernels computes an
operation on given shapes."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Iterator

import torch

from . import native

# (operation, dtype, torch's thread count, operand shapes) -> whether the native kernel
# computes it
_NATIVE_CHOICE: dict[tuple, bool] = {}
NATIVE_BACKENDS = ("auto", "kernels", "torch")


def native_backend() -> str:
    """Whether the layer kernels may use mgrit's native CPU kernels (mgrit.kernels.native), from
    the environment variable MGRIT_NATIVE: "auto" (the default: native convolutions where
    they are measured faster, native dense tanh steps for narrow layers, and relaxation
    phases of such steps compiled into one native call each), "kernels" (the same kernels,
    called step by step or batch by batch from Python: the twin that the compiled phases
    are tested against) or "torch" (torch's kernels only; relaxation phases of narrow
    dense tanh steps are then planned loops of torch's calls, `TorchDenseSteps`).
    torch.use_deterministic_algorithms(True) means "torch": a choice made by timing can
    differ between runs, and torch's results are what a serial run computes."""
    name = os.environ.get("MGRIT_NATIVE", "auto")
    if name not in NATIVE_BACKENDS:
        raise ValueError(f"MGRIT_NATIVE={name!r}: expected one of {', '.join(NATIVE_BACKENDS)}")
    return "torch" if torch.are_deterministic_algorithms_enabled() else name


def compiled_phases() -> bool:
    """Whether relaxation phases of dense tanh steps run as one compiled call each, native
    or planned on torch's kernels (MGRIT_NATIVE "auto" and "torch"), rather than step by
    step ("kernels", the twin of both)."""
    return native_backend() != "kernels"


@contextlib.contextmanager
def torch_kernels() -> Iterator[None]:
    """Torch's kernels only (no native ones) while the context is entered, in this process
    and the ones it starts (MGRIT_NATIVE=torch); the variable's previous value comes back
    after."""
    saved = os.environ.get("MGRIT_NATIVE")
    os.environ["MGRIT_NATIVE"] = "torch"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["MGRIT_NATIVE"]
        else:
            os.environ["MGRIT_NATIVE"] = saved


def _native_chosen(name: str, fns: tuple[Callable, Callable], operands: tuple) -> bool:
    """Whether to compute operation `name` on these operands (tensors or None) with the
    native kernel fns[0] rather than torch's fns[1]. The first call for a set of shapes
    times both on random operands of those shapes and keeps the native kernel where it is
    at least 1.2x faster: on a CPU torch's convolutions are slow for narrow layers and fast
    for wide ones (docs/performance.md has the figures). The choice holds for torch's
    thread count at the time (the native kernel runs on one thread, torch's on all it may
    use) and is made again for another count. Operands that autograd tracks always go to
    torch."""
    x = operands[0]
    if (x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64)
            or native_backend() == "torch"):
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
