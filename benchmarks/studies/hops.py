"""Where the critical path of a training step on P virtual ranks goes: Python frames, torch
dispatch, allocation, message posting and waiting, and arithmetic (docs/performance.md,
"per-hop cost split").

A timed run (`virtual.virtual_traces`, fresh process) is replayed on the cluster network
with `keep_path`, which names the compute spans on the critical path. A counting run of the
same deterministic program (another fresh process, every event matched one to one with the
timed run's) counts per compute span the Python calls, aten ops and those that allocate,
calls into native kernels, and forward and adjoint layer steps, split by whether a native
kernel computed them. Unit costs measured on warm data turn counts into seconds; Python is
what the other categories leave of the measured span time. The same traces replayed with
every compute span cut to its layer arithmetic (`floor`) give the step of an implementation
that did nothing else, with the same messages: what no cut to fixed costs can go below.

    python -m benchmarks.studies.hops [--ranks 64] [--json PATH] [--processes N]

Question: what does one hop on the critical path cost, and what would be left with no
fixed cost at all (the arithmetic floor)?
Answer: about 40 us a hop at 64 ranks, of which about 1 us is arithmetic and the rest
Python and dispatch; the floor bounds 64 ranks at 2.5x one on a 5 us network. Results:
docs/results/history.json (`per_hop_split_w2_64`), docs/performance.md, "The critical
path's per-hop cost".
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import inspect
import json
import os
import statistics
import sys
import threading
import time
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mgrit.app.replay import Event, Interconnect, replay
from mgrit.comm.tracing import Tracer, TracingComm
from mgrit.kernels import dense, native, strategies
from mgrit.kernels.choice import native_backend

from ..scaling import virtual
from ..scaling.cases import CURVES, ScalingCase
from ..scaling.study import CLUSTER_BANDWIDTH, CLUSTER_LATENCY

OVERHEAD = 10.9e-6          # the study's measured per-message CPU overhead on this machine
SHORT = 100e-6              # spans shorter than this are pieces of a hop, longer local phases
COUNTS = ("frames", "ops", "allocs", "native", "fwd_native", "fwd_torch", "adj_native",
          "adj_torch")
FRAMES, OPS, ALLOCS, NATIVE = 0, 1, 2, 3
# strategy method -> (forward or adjoint, the argument that gives the layer count: forward,
# its length; adjoint, its entries that are not all zeros, as a zero cotangent costs no
# arithmetic, whether the caller or the kernel skips it)
LAYER_METHODS = {"step": (4, None), "step_into": (4, None), "single_values": (4, None),
                 "batch": (4, "states"), "batch_into": (4, "states"), "values": (4, "us"),
                 "vjp": (6, "ws"), "vjp_single_into": (6, "w"), "record_single_into": (6, "w")}

_local = threading.local()
_hidden: set = set()        # code of the dispatch mode's machinery: it and all it calls
_skipped: set = set()       # code of this module's wrappers: not counted, what they call is


class _Counts:
    """One rank's counters, counting only while `active` (between communication calls)."""

    __slots__ = ("n", "active", "hidden", "inside")

    def __init__(self) -> None:
        self.n, self.active, self.hidden, self.inside = [0] * len(COUNTS), False, 0, False


def _profile(frame: Any, event: str, arg: Any) -> None:
    counts = getattr(_local, "counts", None)
    if counts is None:
        return
    if event == "call":
        if frame.f_code in _hidden:
            counts.hidden += 1
        elif counts.active and not counts.hidden and frame.f_code not in _skipped:
            counts.n[FRAMES] += 1
    elif event == "return" and frame.f_code in _hidden:
        counts.hidden -= 1


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops a rank dispatches, and those whose output has new storage."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False        # no dynamo wrapper around __torch_dispatch__: fewer frames to hide

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        counts = getattr(_local, "counts", None)
        if counts is not None and counts.active:
            counts.n[OPS] += 1
            name = func.overloadpacket.__name__
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            if name.startswith(("empty", "new_", "zeros")) or any(
                    isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in
                    inputs | {0} for t in tree_flatten(out)[0]):
                counts.n[ALLOCS] += 1
        return out


class CountingTracer(Tracer):
    """A tracer that also keeps, per compute event of each trace, the counts of its span
    (merged like the spans; `history`, one dict per trace). Built in a rank's thread (by
    `virtual_traces`), it starts the profiler and the op counter there for good."""

    def __init__(self, clock: Callable[[], float] = time.thread_time) -> None:
        super().__init__(clock)
        self.counts = _local.counts = _Counts()
        self.history: list[dict[int, list[int]]] = []
        sys.setprofile(_profile)
        _OpCounter().__enter__()

    def start(self) -> None:
        super().start()
        self.history.append({})
        self.counts.n, self.counts.active = [0] * len(COUNTS), True

    def enter(self) -> None:
        self.counts.active = False
        super().enter()

    def leave(self) -> None:
        super().leave()
        self.counts.active = True

    def _compute(self, seconds: float) -> None:
        super()._compute(seconds)
        if seconds > 0.0:   # else the counts go to the next span, as the time does
            span = self.history[-1].setdefault(len(self.events) - 1, [0] * len(COUNTS))
            span[:] = [a + b for a, b in zip(span, self.counts.n)]
            self.counts.n = [0] * len(COUNTS)


def _layer_counter(name: str, original: Callable) -> Callable:
    slot, param = LAYER_METHODS[name]
    index = None if param is None else list(inspect.signature(original).parameters).index(param)

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts = getattr(_local, "counts", None)
        if counts is None or counts.inside:     # a fallback to super(): counted once, outside
            return original(self, *args, **kwargs)
        active, layers = counts.active, 1
        if param is not None:
            arg = args[index - 1] if index - 1 < len(args) else kwargs[param]
            counts.active = False       # what counting takes is not the program's
            layers = (len(arg) if slot == 4 else int(arg.flatten(1).ne(0).any(1).sum())
                      if param == "ws" else int(arg.ne(0).any()))
            counts.active = active
        counts.inside, calls = True, counts.n[NATIVE]
        try:
            result = original(self, *args, **kwargs)
        finally:
            counts.inside = False
        if active and not (name == "record_single_into" and result is None):
            counts.n[slot + (counts.n[NATIVE] == calls)] += layers
        return result
    _skipped.add(counted.__code__)
    return counted


def _program_steps(name: str, args: tuple) -> int:
    """The steps of a native program call (ops, count, h, rows, d): all of a forward one,
    of an adjoint one those whose cotangent (operand 1 of each step's 5, or 8 where it
    records parameter cotangents) is not all zeros, read after the call, when the
    cotangents that earlier steps of the phase write are there."""
    ops, count, _, rows, d = (getattr(a, "value", a) for a in args)
    if "vjp" not in name:
        return count
    width = 8 if "record" in name else 5
    real = ctypes.c_float if name.endswith("f32") else ctypes.c_double
    addresses = (ctypes.c_int64 * (width * count)).from_address(ops)
    return sum(any((real * (rows * d)).from_address(addresses[width * s + 1]))
               for s in range(count))


def _native_counter(fn: Callable) -> Callable:
    """A native kernel that counts its calls; a program (a relaxation phase in one call, its
    symbol named so) also its steps, as no strategy method runs it."""
    name = getattr(fn, "__name__", "")
    slot = (6 if "vjp" in name else 4) if "program" in name else None

    def call(*args: Any) -> Any:
        result = fn(*args)
        counts = getattr(_local, "counts", None)
        if counts is not None and counts.active:
            counts.n[NATIVE] += 1
            if slot is not None and not counts.inside:
                counts.active = False
                counts.n[slot] += _program_steps(name, args)
                counts.active = True
        return result
    _skipped.add(call.__code__)
    return call


def _torch_program_counter(call: Callable) -> Callable:
    """`TorchProgram.__call__` that counts its steps as layers on torch's kernels (an
    adjoint program, those whose cotangent is not all zeros, read after the call as for a
    native program)."""
    def counted(self: Any) -> None:
        call(self)
        counts = getattr(_local, "counts", None)
        if counts is not None and counts.active and not counts.inside:
            counts.active = False
            if self._adjoint:
                counts.n[COUNTS.index("adj_torch")] += sum(bool(step[1].any())
                                                           for step in self._steps)
            else:
                counts.n[COUNTS.index("fwd_torch")] += self.count
            counts.active = True
    _skipped.add(counted.__code__)
    return counted


def _calibrate() -> None:
    """The code the dispatch mode runs around an op: what a few ops call from here."""
    a = torch.ones(1, 32)
    ops = lambda: (torch.add(a, a, out=torch.empty_like(a)), a[0], torch.mm(a, a.t()),  # noqa: E731
                   a.add_(0.0))
    roots: set = set()

    def record(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_back is not None and frame.f_back.f_code is ops.__code__:
            roots.add(frame.f_code)
    with _OpCounter():
        for _ in range(3):
            sys.setprofile(record)
            ops()
            sys.setprofile(None)
    _hidden.update(roots)


@contextlib.contextmanager
def counting() -> Iterator[dict[int, CountingTracer]]:
    """While entered, `virtual.virtual_traces` counts: its tracers by rank."""
    tracers: dict[int, CountingTracer] = {}

    def tracing(comm: Any, tracer: Tracer) -> TracingComm:
        tracers[comm.rank] = tracer
        return TracingComm(comm, tracer)
    init = dense.NativeDense.__init__

    def native_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        wrap = lambda f: _native_counter(f) if isinstance(f, ctypes._CFuncPtr) else f  # noqa: E731
        for key, value in list(vars(self).items()):
            setattr(self, key, tuple(map(wrap, value)) if isinstance(value, tuple)
                    else {k: wrap(v) for k, v in value.items()} if isinstance(value, dict)
                    else wrap(value))
    patches = [(virtual, "Tracer", CountingTracer), (virtual, "TracingComm", tracing),
               (dense.NativeDense, "__init__", native_init),
               (dense.TorchProgram, "__call__",
                _torch_program_counter(dense.TorchProgram.__call__))]
    classes, todo = [], [strategies.ChainSteps]
    while todo:                 # every strategy class, subclasses of subclasses included
        classes.append(todo.pop())
        todo += classes[-1].__subclasses__()
    for cls in classes:
        patches += [(cls, n, _layer_counter(n, f)) for n, f in vars(cls).items()
                    if n in LAYER_METHODS]
    saved = [(obj, name, obj.__dict__[name]) for obj, name, _ in patches]
    _calibrate()
    for obj, name, value in patches:
        setattr(obj, name, value)
    threading.setprofile(_profile)
    try:
        yield tracers
    finally:
        threading.setprofile(None)
        for obj, name, value in saved:
            setattr(obj, name, value)


def counted_run(case: ScalingCase, ranks: int, repeats: int, warmup: int
                ) -> tuple[list[list[list[Event]]], list[list[dict[int, list[int]]]]]:
    """Traces [repeat][rank] of the counting run and the counts of their compute events."""
    with counting() as tracers:
        traces = virtual.virtual_traces(case, ranks, repeats, warmup)
    return traces, [[tracers[r].history[k] for r in range(ranks)] for k in range(repeats)]


def align(timed: list[list[Event]], counted: list[list[Event]]) -> None:
    """Raise ValueError unless two runs' traces have the same events but compute seconds."""
    if len(timed) != len(counted):
        raise ValueError(f"{len(timed)} ranks timed, {len(counted)} counted")
    for r, (a, b) in enumerate(zip(timed, counted)):
        for i in range(max(len(a), len(b))):
            x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
            if x is None or y is None or (x != y if x[0] != "compute" else y[0] != "compute"):
                raise ValueError(f"rank {r}, event {i}: {x!r} timed, {y!r} counted: the runs "
                                 "do not align")


def unit_costs(width: int = 32, layers: int = 256, rounds: int = 200, calls: int = 20
               ) -> dict[str, float]:
    """Seconds of one aten op (torch.add with out=, its arithmetic negligible), of an
    allocation on top, of a raw native call past its arithmetic, and of one layer's forward
    and adjoint arithmetic, batched over `layers` (native and torch's)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(1, width, generator=g) for _ in range(3))
    u, out, y = (torch.randn(layers, 1, width, generator=g) for _ in range(3))
    w, bias = torch.randn(layers, width, width, generator=g) / width, torch.randn(layers, width)

    def time_of(fn: Callable[[], Any]) -> float:
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - start) / calls)
        return statistics.median(samples)
    units = {"op": time_of(lambda: torch.add(a, b, out=c))}
    units["alloc"] = time_of(lambda: torch.add(a, b)) - units["op"]
    wt = w.transpose(1, 2)
    units["fwd_torch"] = time_of(lambda: torch.add(
        u, torch.tanh(torch.baddbmm(bias[:, None], u, wt)), alpha=0.1)) / layers
    units["adj_torch"] = time_of(lambda: torch.add(
        out, torch.bmm(out * (1 - y * y), w), alpha=0.1)) / layers
    if native.available():
        k = dense.NativeDense(torch.float32, width)
        units["fwd_native"] = time_of(lambda: k.step_batch(u, w, bias, 0.1, out)) / layers
        units["adj_native"] = time_of(lambda: k.vjp(w, u, y, 0.1, out)) / layers
        step_one = native.library().mgrit_dense_tanh_one_f32
        ptrs = (u.data_ptr(), w.data_ptr(), bias.data_ptr(), None, out.data_ptr(), None)
        units["native_call"] = time_of(lambda: step_one(*ptrs, 0.1, 1, width)) - units[
            "fwd_native"]
    else:
        units.update(fwd_native=units["fwd_torch"], adj_native=units["adj_torch"],
                     native_call=0.0)
    return units


def split(spans: list[tuple[float, list[int]]], units: dict[str, float]) -> dict[str, Any]:
    """Seconds per category of compute spans (seconds, counts): arithmetic, dispatch and
    allocation from counts and units, Python the rest; with the summed counts."""
    n = dict(zip(COUNTS, (sum(c[k] for _, c in spans) for k in range(len(COUNTS)))))
    total = sum(s for s, _ in spans)
    arithmetic_ = arithmetic([n[k] for k in COUNTS], units)
    dispatch = (n["ops"] - n["allocs"]) * units["op"] + n["native"] * units["native_call"]
    allocation = n["allocs"] * (units["op"] + units["alloc"])
    python = total - arithmetic_ - dispatch - allocation
    return {"spans": len(spans), "compute": total, "python": python, "dispatch": dispatch,
            "allocation": allocation, "arithmetic": arithmetic_, "counts": n,
            "per_frame": python / n["frames"] if n["frames"] else 0.0}


def arithmetic(counts: list[int], units: dict[str, float]) -> float:
    """Seconds of the layer arithmetic that a span's counts hold."""
    return sum(counts[COUNTS.index(k)] * units[k]
               for k in ("fwd_native", "fwd_torch", "adj_native", "adj_torch"))


def floor(traces: list[list[Event]], counts: list[dict[int, list[int]]],
          units: dict[str, float], network: Interconnect) -> dict[str, Any]:
    """The replay of `traces` with every compute span cut to its layer arithmetic (its
    counts times the unit costs): the step of an implementation whose ranks did nothing but
    the layers' arithmetic, with the same steps, messages and collectives on the same
    network. The arithmetic is priced batched, so the figure is if anything low."""
    zero = [0] * len(COUNTS)
    cut = [[["compute", arithmetic(counts[r].get(i, zero), units)] if e[0] == "compute"
            else e for i, e in enumerate(t)] for r, t in enumerate(traces)]
    pred = replay(cut, network)
    return {"predicted": pred.total, "critical": pred.critical,
            "arithmetic": sum(e[1] for t in cut for e in t if e[0] == "compute")}


def measure(case: ScalingCase, ranks: int, warmup: int = 3, repeats: int = 3,
            network: Interconnect | None = None, processes: int = 1,
            run: Callable[..., Any] = virtual.fresh, rounds: int = 200) -> dict[str, Any]:
    """The split of the critical path (and of all compute) of `case` on `ranks` virtual
    ranks; `run(fn, *args)` runs each part (a fresh process by default)."""
    network = network or Interconnect(CLUSTER_LATENCY, CLUSTER_BANDWIDTH, OVERHEAD)
    timed = [t for _ in range(processes)
             for t in run(virtual.virtual_traces, case, ranks, repeats, warmup)]
    preds = [replay(t, network, keep_path=True) for t in timed]
    best = min(range(len(timed)), key=lambda k: preds[k].total)
    traces, pred = timed[best], preds[best]
    counted, counts = run(counted_run, case, ranks, repeats, warmup)
    for k, other in enumerate(counted):
        align(timed[k % repeats], other)
    counts = counts[best % repeats]
    units = run(unit_costs, 32, 256, rounds)
    critical = [(traces[r][i][1], counts[r].get(i, [0] * len(COUNTS))) for r, i in pred.path]
    busy = [(e[1], counts[r].get(i, [0] * len(COUNTS))) for r, t in enumerate(traces)
            for i, e in enumerate(t) if e[0] == "compute"]
    sends = sum(e[0] == "send" for t in traces for e in t)
    return {"environment": {"torch": torch.__version__, "python": sys.version.split()[0],
                            "MGRIT_NATIVE": os.environ.get("MGRIT_NATIVE", "auto"),
                            "backend": native_backend(), "native_available": native.available()},
            "case": case.name, "ranks": ranks, "warmup": warmup, "repeats": repeats,
            "processes": processes, "network": vars(network), "predicted": pred.total,
            "critical": pred.critical, "units": units, "sends": sends,
            "floor": floor(traces, counts, units, network),
            "floor_no_latency": floor(traces, counts, units,
                                      Interconnect(0.0, network.bandwidth, network.overhead)),
            "columns": {"critical": split(critical, units), "busy": split(busy, units),
                        "short": split([s for s in critical if s[0] < SHORT], units),
                        "long": split([s for s in critical if s[0] >= SHORT], units)}}


def table(result: dict[str, Any]) -> str:
    """The markdown table of a `measure` result: seconds in ms, per hop in us."""
    cols, hops = result["columns"], result["critical"]["hops"]
    rows = ["|  | critical path (ms) | per hop (us) | all ranks' compute (ms) | hop pieces < "
            f"{SHORT * 1e6:.0f} us (ms) | local phases (ms) |", "| --- |" + " ---: |" * 5]

    def row(label: str, values: dict[str, Any], scale: float = 1e3, form: str = ".3f") -> None:
        cell = lambda v, f=form, s=scale: "-" if v is None else format(v * s, f)  # noqa: E731
        per_hop = values["critical"] / hops if hops else None
        rows.append(f"| {label} | {cell(values['critical'])} | "
                    f"{cell(per_hop, '.1f', 1) if scale == 1 else cell(per_hop, s=1e6)} | "
                    + " | ".join(cell(values.get(k)) for k in ("busy", "short", "long")) + " |")
    for key, label in [("python", "Python frames (remainder)"), ("dispatch", "torch dispatch"),
                       ("allocation", "allocation"), ("arithmetic", "arithmetic")]:
        row(label, {k: c[key] for k, c in cols.items()})
    comm = {"critical": result["critical"]["communication"],
            "busy": result["sends"] * result["network"]["overhead"]}
    row("message posting and waiting", comm)
    row("total", {k: c["compute"] + comm.get(k, 0.0) for k, c in cols.items()})
    row("count: spans", {k: c["spans"] for k, c in cols.items()}, 1, "d")
    for key in COUNTS:
        row(f"count: {key}", {k: c["counts"][key] for k, c in cols.items()}, 1, "d")
    per_frame = {k: c["per_frame"] for k, c in cols.items()}
    rows.append(f"| us per Python frame | {per_frame['critical'] * 1e6:.3f} | - | "
                + " | ".join(f"{per_frame[k] * 1e6:.3f}" for k in ("busy", "short", "long"))
                + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--case", default="w2",
                        choices=[n for n, c in CURVES.items() if not c.costed])
    parser.add_argument("--variant", type=int,
                        help="W2 with this hierarchy of benchmarks.studies.hierarchies "
                             "(its number in VARIANTS, 0 the default) instead of --case")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--processes", type=int, default=1,
                        help="timed runs, each in a fresh process; the fastest is split")
    parser.add_argument("--overhead", type=float, default=OVERHEAD,
                        help="per-message CPU overhead of the modelled network (s)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    network = Interconnect(CLUSTER_LATENCY, CLUSTER_BANDWIDTH, args.overhead)
    case: Any = CURVES[args.case]
    if args.variant is not None:
        from .hierarchies import VARIANTS, HierarchyCase

        case = HierarchyCase(list(VARIANTS)[args.variant])
    result = measure(case, args.ranks, args.warmup, args.repeats, network, args.processes)
    env = result["environment"]
    print(f"{case.name} on {args.ranks} virtual ranks, MGRIT_NATIVE={env['MGRIT_NATIVE']}, "
          f"torch {env['torch']}: predicted {result['predicted'] * 1e3:.3f} ms, "
          f"{result['critical']['hops']} hops\n")
    print(table(result))
    low = result["floor"]
    print(f"\nlayer arithmetic only (every span cut to its arithmetic, same messages): "
          f"predicted {low['predicted'] * 1e3:.3f} ms, {low['critical']['hops']} hops, "
          f"{low['critical']['communication'] * 1e3:.3f} ms of them; all ranks' arithmetic "
          f"{low['arithmetic'] * 1e3:.3f} ms; with no latency "
          f"{result['floor_no_latency']['predicted'] * 1e3:.3f} ms")
    print("\nunits (us): " + ", ".join(f"{k} {v * 1e6:.3f}" for k, v in result["units"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
