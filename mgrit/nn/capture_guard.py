"""A guard that makes host reads of tensors raise: what a captured training step must not
do, found by running the step once under it, and named.

A CUDA graph replays kernels and nothing else: a value read on the host while it was
captured (`.item()`, `float(t)`, `if t:`, `.tolist()`, a copy to the CPU) is baked into the
graph as the number it was then, and the read itself waits for the device, which a step that
should run ahead of the host cannot afford. The guard patches those Tensor methods while a
thread is inside it, and they raise in that thread alone. Reads by the communicator
(`mgrit.comm`: messages between ranks go through host buffers, between graphs) and reads of
tensors named `allowed` (the host-side step counts of torch's optimizers on a CPU) go
through.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import torch
from torch import Tensor, nn

# Tensor methods that read values on the host (or, for `cpu`, copy them there)
_READS = ("item", "tolist", "numpy", "cpu", "nonzero", "__bool__", "__float__", "__int__",
          "__index__", "__complex__")
_TORCH_DIR = os.path.dirname(torch.__file__)
_GUARD = os.path.abspath(__file__)


class HostSyncError(Exception):
    """A tensor was read on the host inside a step that is to be captured. Deliberately not
    a RuntimeError: code that catches those (probes of what a module supports) must not
    swallow it."""


def _from_comm() -> bool:
    """Whether the guarded method's caller is the communicator: the first frame up that is
    not a guard's (guards nest: an outer one is called by an inner one)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("mgrit.comm")


def _to_host(tensor: Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether `tensor.to(*args, **kwargs)` moves it between the host and a device."""
    targets = [kwargs.get("device"), *args]
    for target in targets:
        if isinstance(target, (str, torch.device)):
            device = torch.device(target)
            if (device.type == "cpu") != (tensor.device.type == "cpu"):
                return True
    return False


# the patches are installed while any thread is inside a guard (`_installed` counts them)
# and raise only in those threads: virtual ranks are threads of one process, and a rank
# that reads a tensor after its step must not fail because another rank's step is guarded
_lock = threading.Lock()
_installed: list[Any] = [0, []]         # [threads inside, (name, original, own) saved]
_local = threading.local()              # .allowed: a stack of id sets, one per guard entered


def _forbidden(tensor: Tensor) -> bool:
    """Whether reading `tensor` on the host raises here: this thread is inside a guard that
    does not allow it, and the communicator is not the reader."""
    stack = getattr(_local, "allowed", None)
    return bool(stack) and id(tensor) not in stack[-1] and not _from_comm()


def _guard(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(self: Tensor, *args: Any, **kwargs: Any) -> Any:
        if _forbidden(self):
            raise HostSyncError(f"Tensor.{name.strip('_')}() of a tensor of shape "
                                f"{tuple(self.shape)} on {self.device}")
        return original(self, *args, **kwargs)
    return guarded


def _guard_to(original: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(self: Tensor, *args: Any, **kwargs: Any) -> Any:
        if _to_host(self, args, kwargs) and _forbidden(self):
            raise HostSyncError(f"Tensor.to() between host and device of a tensor of "
                                f"shape {tuple(self.shape)} on {self.device}")
        return original(self, *args, **kwargs)
    return guarded


def _install() -> None:
    with _lock:
        if _installed[0] == 0:
            for name in (*_READS, "to"):
                original = getattr(Tensor, name)
                _installed[1].append((name, original, name in Tensor.__dict__))
                setattr(Tensor, name,
                        _guard_to(original) if name == "to" else _guard(name, original))
        _installed[0] += 1


def _uninstall() -> None:
    with _lock:
        _installed[0] -= 1
        if _installed[0] == 0:
            for name, original, own in reversed(_installed[1]):
                if own:
                    setattr(Tensor, name, original)
                else:
                    delattr(Tensor, name)
            _installed[1].clear()


@contextlib.contextmanager
def host_reads_forbidden(allowed: Iterable[Tensor] = ()) -> Iterator[None]:
    """While entered, a host read of a tensor (`Tensor.item`, `tolist`, `numpy`, `cpu`,
    `nonzero`, `bool`/`float`/`int`/`index` of a tensor, `to` between host and device) in
    this thread raises `HostSyncError`, except by the communicator and of the tensors in
    `allowed`; other threads read as they like."""
    stack = getattr(_local, "allowed", None)
    if stack is None:
        stack = _local.allowed = []
    stack.append({id(t) for t in allowed})
    _install()
    try:
        yield
    finally:
        _uninstall()
        stack.pop()


def culprit(err: BaseException, model: nn.Module) -> str:
    """Where a `HostSyncError` was raised, in words: the innermost module whose code made
    the read (its name in `model`, or its class where it is not registered there, as the
    step module's template is not) and the innermost line outside torch and this guard."""
    names = {id(m): name for name, m in model.named_modules()}
    owner_named = line = None
    for frame, lineno in reversed(list(traceback.walk_tb(err.__traceback__))):
        path = os.path.abspath(frame.f_code.co_filename)
        if path == _GUARD:
            continue
        if line is None and not path.startswith(_TORCH_DIR):
            line = f"{frame.f_code.co_name} at {path}:{lineno}"
        owner = frame.f_locals.get("self")
        if owner_named is None and isinstance(owner, nn.Module):
            name = names.get(id(owner))
            owner_named = (f"module {name!r} ({type(owner).__name__})" if name
                           else f"module {type(owner).__name__}")
        elif owner_named is None and isinstance(owner, torch.optim.Optimizer):
            owner_named = f"optimizer {type(owner).__name__}"
        if owner_named is not None and line is not None:
            break
    if owner_named is None:
        return line or "code outside any module"
    return f"{owner_named}, in {line}" if line else owner_named
