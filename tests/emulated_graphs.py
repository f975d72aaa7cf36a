"""A CPU stand-in for CUDA graph capture that replays what was recorded and nothing else, so
that a captured step's replays are tested without a GPU as a graph would run them: no Python
of the step runs, and whatever the step decided or counted on the host stays as it was at
capture.

`EmulatedCapture` has the `warm_up` and `capture` of `mgrit.execute.CudaCapture`. Its
`capture(like, run)` runs `run` once while recording every aten operation (a dispatch mode)
with the tensors it read and made; `replay()` then runs those operations again on the same
tensors, as a graph's kernels run on the memory they were captured with:
- in-place and `out=` operations run again on the tensors they wrote;
- an out-of-place operation runs again and its result is copied into the tensor the capture
  made (that tensor is what later operations, and the step's caller, hold);
- views are not made again (the captured ones alias the same memory), nor allocations
  without a kernel (`empty`);
- a value read on the host while recording (`item()`, `bool(t)`) raises, as it cannot be
  captured.
Unlike a CUDA graph, capturing here runs the work, so the replay right after a capture (which
`CapturedStep` makes, a graph's first run) is skipped. With a model's `Cuts` (several ranks),
`capture` cuts the recording at every message, as `CudaCapture` does (`capture_between`):
each stretch between two messages is a graph of its own, the messages are host steps (their
own operations are not recorded), and the result is a `mgrit.execute.graphs.Segmented`. Work that does not go through torch's
dispatcher (mgrit's native C kernels, called with pointers) is not recorded: use models with
`kernels="torch"`. Inside `step_counts_on_the_device`, torch's Adam keeps its step counts
on the CPU's tensors as it does on a GPU (capturable=True), for replays of its update.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Iterator

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

from mgrit.execute.graphs import Segmented, capture_between

aten = torch.ops.aten
# allocations a graph makes once, at capture, with no kernel to replay
ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
               aten.new_empty.default, aten.new_empty_strided.default}
# operations that hand a tensor's value to the host
HOST_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}


class HostRead(RuntimeError):
    """A value was read on the host while a run was recorded."""


class _Recording(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.paused = False     # between graphs: a host step's own operations

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if func in HOST_READS:
            raise HostRead(f"{func} while capturing")
        out = func(*args, **kwargs)
        if func not in ALLOCATIONS and not func.is_view:
            self.ops.append((func, args, kwargs, out))
        return out


class EmulatedGraph:
    def __init__(self, ops: list[tuple[Any, tuple, dict, Any]]) -> None:
        self.ops = ops
        self.replays = 0
        self._captured_run_pending = True

    def replay(self) -> None:
        if self._captured_run_pending:      # capturing ran the work once already
            self._captured_run_pending = False
            return
        self.replays += 1
        # the operations as the dispatcher ran them, below autograd: a graph replays
        # kernels, not the recording of an autograd graph, and moves no tensor's version
        # counter (a cache that trusts one must not see a replay as no change)
        with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
            for func, args, kwargs, out in self.ops:
                result = func(*args, **kwargs)
                if func._schema.is_mutable:
                    continue
                made, _ = tree_flatten(out)
                again, _ = tree_flatten(result)
                for tensor, value in zip(made, again):
                    if isinstance(tensor, Tensor):
                        tensor.copy_(value)


class EmulatedCapture:
    """`warm_up` runs; `capture` records (`EmulatedGraph`). Counts both."""

    def __init__(self) -> None:
        self.warm_ups = self.captured = 0
        self.graphs: list[EmulatedGraph] = []
        self.programs: list[Segmented] = []

    def warm_up(self, like: Tensor, run: Callable[[], None]) -> None:
        self.warm_ups += 1
        run()

    def capture(self, like: Tensor, run: Callable[[], None], cuts: Any = None) -> Any:
        """One `EmulatedGraph` of `run`; with `cuts`, a `Segmented` run of them between its
        messages (as `CudaCapture` makes on several ranks)."""
        self.captured += 1
        recording = _Recording()
        if cuts is None:
            with recording:
                run()
            graph = EmulatedGraph(recording.ops)
            self.graphs.append(graph)
            return graph

        def begin() -> None:
            recording.ops, recording.paused = [], False

        def end() -> EmulatedGraph | None:
            recording.paused = True
            if not recording.ops:
                return None
            graph = EmulatedGraph(recording.ops)
            graph._captured_run_pending = False     # `Segmented` skips the whole first run
            self.graphs.append(graph)
            return graph

        with recording:
            program = capture_between(cuts, run, begin, end)
        self.programs.append(program)
        return program

    @property
    def replays(self) -> int:
        """Replays of the graphs, or of the runs of graphs between messages."""
        if self.programs:
            return sum(p.replays for p in self.programs)
        return sum(g.replays for g in self.graphs)


@contextlib.contextmanager
def step_counts_on_the_device() -> Iterator[None]:
    """torch's Adam keeps its step counts on the parameters' device (capturable=True) only
    on devices that capture graphs, and refuses that on a CPU; inside, it accepts the CPU,
    so that emulated replays run the update a GPU's graph runs: step counts and bias
    corrections as tensors, with no host read."""
    adam = importlib.import_module("torch.optim.adam")
    supported = adam._get_capturable_supported_devices
    adam._get_capturable_supported_devices = lambda *a, **k: [*supported(*a, **k), "cpu"]
    try:
        yield
    finally:
        adam._get_capturable_supported_devices = supported
