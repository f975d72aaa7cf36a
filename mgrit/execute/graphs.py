"""CUDA graphs of whole relaxation sweeps: captured at a sweep's second use, replayed
after, while the memory the sweep reads stays where it was; and runs captured as graphs
between their messages (`Segmented`, `capture_between`)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, Callable, Hashable, TypeVar

import torch
from torch import Tensor

from ..comm.cuts import Cuts
from ..core.propagator import Capabilities

T = TypeVar("T")


class CudaCapture:
    """Warm-up runs and captures of sweeps on one side stream per device: libraries create
    some handles lazily per stream (cuBLAS, cuBLASLt), and creating one while capturing
    fails, so a sweep is warmed up on the stream it is then captured on."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def warm_up(self, like: Tensor, sweep: Callable[[], None]) -> None:
        """Run `sweep` on the side stream, ordered after and before the caller's work."""
        stream, caller = self._stream(like.device), torch.cuda.current_stream(like.device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            sweep()
        caller.wait_stream(stream)

    def capture(self, like: Tensor, sweep: Callable[[], None], cuts: Cuts | None = None
                ) -> Any:
        """A CUDA graph of `sweep`'s kernels (capturing runs none of them); with `cuts`
        (of the communicators `sweep` sends with), a `Segmented` run of graphs between its
        messages (capturing runs it once)."""
        with _stale_streams_overridden():
            if cuts is not None:
                return self._capture_between(like, sweep, cuts)
            return self._capture_one(like, sweep)

    def _capture_one(self, like: Tensor, sweep: Callable[[], None]) -> Any:
        """One graph of `sweep` on the side stream, as `torch.cuda.graph` makes it, but a
        sweep that fails ends the capture and raises its own error: `torch.cuda.graph`
        ends it with `capture_end`, whose error on the invalidated capture would hide the
        sweep's and leave the side stream current."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()        # as torch.cuda.graph does before a capture
        with torch.cuda.stream(self._stream(like.device)):
            graph.capture_begin()
            try:
                sweep()
            except BaseException:
                with contextlib.suppress(Exception):
                    graph.capture_end()
                raise
            graph.capture_end()
        return graph

    def _capture_between(self, like: Tensor, run: Callable[[], None], cuts: Cuts
                         ) -> "Segmented":
        """`run` as graphs between its messages, on the side stream, their memory from one
        pool (graphs that share a pool must replay in the order they were captured, which
        a `Segmented` does)."""
        stream, caller = self._stream(like.device), torch.cuda.current_stream(like.device)
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()        # as torch.cuda.graph does before a capture
        graphs: list[Any] = []

        def begin() -> None:
            graphs.append(torch.cuda.CUDAGraph())
            # relaxed: a training step's adjoint solve runs inside loss.backward(), on
            # autograd's device thread, so a graph begun there may end on the caller's
            # thread and the other way round, which the other modes refuse
            # (cudaErrorStreamCaptureWrongThread); host reads are refused before any
            # capture by the guarded run, and no capture is open while a message runs
            graphs[-1].capture_begin(pool=pool, capture_error_mode="relaxed")

        def end() -> Any:
            graph = graphs[-1]
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                graph.capture_end()
            empty = False
            for w in seen:      # a graph between two messages may hold no work
                if "CUDA Graph is empty" in str(w.message):
                    empty = True
                else:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            if empty:
                return None
            graph.replay()      # the host step after it reads what it computes
            return graph

        def abort() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graphs[-1].capture_end()

        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            program = capture_between(cuts, run, begin, end, abort)
        caller.wait_stream(stream)
        return program


@contextlib.contextmanager
def _stale_streams_overridden() -> Iterator[None]:
    """Inside: autograd runs a node whose stream is a stale non-capturing one (the stream
    of an eager step before the capture, or of a probe between replays, kept by a node
    that outlived its step) on the capturing stream, where without this a capture of a
    backward pass fails. Where torch has no such switch, nothing changes."""
    setter = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    getter = getattr(torch._C, "_override_stale_capture_stream", None)
    if setter is None or getter is None:
        yield
        return
    before = getter()
    setter(True)
    try:
        yield
    finally:
        setter(before)


class Segmented:
    """A run captured as graphs between host steps (its messages, `mgrit.comm.cuts`): a
    replay runs them in the run's order. Capturing ran the run once (each graph was run as
    soon as it was captured, before the host step that reads it), so the first replay,
    which the capturer's caller makes as after any capture, is skipped."""

    def __init__(self) -> None:
        self.steps: list[Callable[[], Any]] = []
        self.graphs = 0
        self.host_steps = 0
        self.replays = 0
        self._ran = True

    def replay(self) -> None:
        if self._ran:
            self._ran = False
            return
        self.replays += 1
        for step in self.steps:
            step()


class _Cutting:
    """The session (`mgrit.comm.cuts.Session`) of a run captured between its messages:
    `begin()` starts capturing a graph; `end()` ends it and returns the graph, run once,
    or None where it holds no work."""

    def __init__(self, begin: Callable[[], None], end: Callable[[], Any]) -> None:
        self._begin, self._end = begin, end
        self.program = Segmented()
        self.capturing = False

    def open(self) -> None:
        self._begin()
        self.capturing = True

    def close(self) -> None:
        self.capturing = False
        graph = self._end()
        if graph is not None:
            self.program.steps.append(graph.replay)
            self.program.graphs += 1

    def host(self, action: Callable[[], T], replay: bool = True) -> T:
        self.close()
        result = action()
        if replay:
            self.program.steps.append(action)
            self.program.host_steps += 1
        self.open()
        return result


def capture_between(cuts: Cuts, run: Callable[[], None], begin: Callable[[], None],
                    end: Callable[[], Any], abort: Callable[[], None] | None = None
                    ) -> Segmented:
    """`run` captured as graphs between its messages (`begin` and `end` as `_Cutting`
    takes them: CUDA's, or a test's stand-in); a run that fails or leaves a message
    incomplete ends the capture in progress (`abort`, default `end`) and raises."""
    session = _Cutting(begin, end)
    cuts.begin(session)
    try:
        session.open()
        run()
        session.close()
    except BaseException:
        if session.capturing:
            session.capturing = False
            try:
                (abort or end)()
            except Exception:   # pragma: no cover - the run's own error is the one to see
                pass
        cuts.end(complete=False)
        raise
    cuts.end()
    return session.program


class SweepGraphs:
    """CUDA graphs of relaxation sweeps, one per sweep of a solver's level.

    `run(key, like, sweep)` runs `sweep` (a function of tensor work only: no
    communication, no host reads, no Python state that a later call needs) eagerly on its
    first use, as the warm-up that capturing needs (library handles, workspaces, cached
    views), captures it on its second and replays the graph from then on (`capture`:
    `CudaCapture`, or a stand-in with its methods `warm_up` and `capture`). A graph
    replays the kernels on the memory they were captured with, so it is kept only while the
    propagator's `graph_key()` (of its capabilities `caps`) stays the same (its parameters'
    storage: a conversion such as `.double()` moves it) and not used while that key is None
    (the propagator is doing something a replay would skip, such as keeping outputs for the
    backward pass). States on another device than CUDA, or a propagator without
    `graph_key`, run eagerly.
    """

    device_types: tuple[str, ...] = ("cuda",)

    def __init__(self, caps: Capabilities, capture: Any = None) -> None:
        self.caps = caps
        self._graph_key = caps.graph_key
        self._capture = capture if capture is not None else CudaCapture()
        # sweep key -> [propagator's graph key, uses so far, graph or None]
        self._sweeps: dict[Hashable, list] = {}
        self.captured = 0
        self.replayed = 0

    def run(self, key: Hashable, like: Tensor, sweep: Callable[[], None]) -> None:
        graph_key = self._graph_key
        token = (graph_key() if graph_key is not None and like.device.type in self.device_types
                 else None)
        if token is None:
            sweep()
            return
        entry = self._sweeps.get(key)
        if entry is None or entry[0] != token:
            entry = self._sweeps[key] = [token, 0, None]     # drops a stale graph
        entry[1] += 1
        if entry[1] == 1:
            self._capture.warm_up(like, sweep)
            return
        if entry[2] is None:
            entry[2] = self._capture.capture(like, sweep)
            self.captured += 1
        entry[2].replay()
        self.replayed += 1
