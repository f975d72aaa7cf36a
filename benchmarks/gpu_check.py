"""Speed of mgrit on one GPU next to the strongest serial baselines (run by gpu_check.sh;
correctness is `pytest -m gpu`).

    python benchmarks/gpu_check.py [--out DIR] [--device cuda|cpu] [--workloads w2,w2b,w4,w1]
        [--compile w1,w2,w2b,w4] [--repeats N] [--budget SECONDS] [--job-limit SECONDS]
        [--compile-limit SECONDS]

Every method of `METHODS` times a no-grad forward pass and a whole training step (forward,
loss, backward, optimizer update) of each workload, all methods of a workload next to each
other in one process (the baseline and mgrit's captured step and forward pass first, so
that a job cut off by its limit loses the others), with CUDA events after untimed warm-up
calls (median of the repeats). The first method, serial PyTorch with the whole step
captured as one CUDA graph, is the strongest baseline; every ratio is against it.
torch.compile (mode "reduce-overhead") runs last, in a process of its own per workload
under --compile-limit, so a slow compile costs no other measurement. Before it is timed,
every method's first forward output and first update (from the common initial weights) are
compared with serial eager PyTorch's: a method that times something else than the step
shows there.

DIR/gpu-<device>.json is rewritten after every method, so a run stopped by its time limit
keeps all it measured, with its verdict on each of `TARGETS` (each captured setting's time
over the one-graph step's; not judged where either was not timed); DIR/gpu-<device>.md is
the table of both. A method that cannot run here
(CUDA only, or a part of mgrit that does not exist yet) is recorded as not available; one
that fails, or whose process runs past its limit, as failed or timed out. The exit status
is 1 if a method other than torch.compile failed or timed out, 2 without a CUDA device.
`--device cpu` is the dry run: small workloads, CPU timers, torch.compile with the
"aot_eager" backend, every path but the CUDA-only calls.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):   # run as a script: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import Tensor, nn

from benchmarks.timing import median_seconds
from benchmarks.training import parallel_model, sequential_variant, serial_network
from benchmarks.workloads import TrainingWorkload, w1, w1_workload, w2, w2_workload, w4_workload

METRICS = ("train_step", "forward")   # the step first: it matters most if time runs out
DEEP_W4_BLOCKS = 256


# Workloads -----------------------------------------------------------------------------

def workload(name: str, small: bool) -> TrainingWorkload:
    """The timed workload `name`; `small` (the CPU dry run): the same kind, a few layers.
    W4 is the deep transformer without dropout: its draws would change every step, which a
    captured step takes as device tensors, and its arithmetic is what is timed."""
    if name in ("w2", "w2b"):
        work = w2_workload(batch=1 if name == "w2" else 32)
        return replace(work, network=lambda: w2(num_steps=64)) if small else work
    if name == "w1":
        work = w1_workload()
        return replace(work, network=lambda: w1(num_steps=16)) if small else work
    if name == "w4":
        if small:
            return w4_workload(batch=2, num_steps=16, width=16, heads=2, context=8,
                               dropout=0.0)
        return w4_workload(num_steps=DEEP_W4_BLOCKS, dropout=0.0)
    raise ValueError(f"unknown workload {name!r}; choose from {list(WORKLOADS)}")


# in the order their methods are timed: those the targets are about first, so that a run
# whose budget the correctness tests left short loses W1 (no target) before them
WORKLOADS = ("w2", "w2b", "w4", "w1")


@dataclass
class Batch:
    """The workload's batch on the device, the same for every method."""

    work: TrainingWorkload
    device: torch.device
    x: Tensor
    y: Tensor


# Methods ---------------------------------------------------------------------------------

class NotAvailable(Exception):
    """A method that cannot run here (it needs CUDA, or a part of mgrit that is not there
    yet): recorded with its reason, not as a failure."""


@dataclass
class Timed:
    """What a method times: `forward()` returns the no-grad output, `train_step()` makes one
    whole step; either may be None (not timed). `optimizer`: whose state a reset clears."""

    forward: Callable[[], Tensor] | None
    train_step: Callable[[], object] | None
    optimizer: torch.optim.Optimizer | None = None
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    """A way to run a workload: `network` builds the model it runs (from the workload's
    seed, so every method starts from the same weights), `prepare` makes its timed calls
    (warm-ups, captures). `exact`: it computes serial autograd's step (to round-off)."""

    name: str
    network: Callable[[TrainingWorkload], nn.Module]
    prepare: Callable[[nn.Module, Batch], Timed]
    exact: bool
    cuda_only: bool = False
    only: tuple[str, ...] = ()        # the workloads it is timed on (empty: all)
    # timed before the others of its workload (`run_job`): the baseline and what the
    # targets are about, so that a job cut off by its limit has lost the rest
    early: bool = False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capturable(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer with its state on the device (Adam's step counts), as a CUDA graph
    needs; before its first step, so that the state is made there."""
    if "capturable" in optimizer.defaults:
        for group in optimizer.param_groups:
            group["capturable"] = True
    return optimizer


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch,
          x: Tensor, y: Tensor) -> None:
    """One training step without zeroing the gradients (a captured step makes them)."""
    batch.work.loss(model(x), y).backward()
    optimizer.step()


def eager(model: nn.Module, batch: Batch) -> Timed:
    """The model run as written, one launch per operation."""
    optimizer = batch.work.optimizer(model.parameters())

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        _step(model, optimizer, batch, batch.x, batch.y)

    def forward() -> Tensor:
        with torch.no_grad():
            return model(batch.x)
    return Timed(forward, train_step, optimizer)


def one_graph(model: nn.Module, batch: Batch) -> Timed:
    """The whole training step (forward, loss, backward, optimizer update with a capturable
    optimizer) captured as one CUDA graph, and the no-grad forward as another, as a careful
    user of a launch-bound network runs them: warmed up on a side stream, gradients made in
    the graph's memory, inputs copied into static buffers before each replay."""
    optimizer = capturable(batch.work.optimizer(model.parameters()))
    x, y = batch.x.clone(), batch.y.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            _step(model, optimizer, batch, x, y)
        with torch.no_grad():
            for _ in range(3):
                model(x)
    torch.cuda.current_stream().wait_stream(side)
    step_graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(step_graph):
        _step(model, optimizer, batch, x, y)
    forward_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(forward_graph), torch.no_grad():
        out = model(x)

    def train_step() -> None:
        x.copy_(batch.x)
        y.copy_(batch.y)
        step_graph.replay()

    def forward() -> Tensor:
        x.copy_(batch.x)
        forward_graph.replay()
        return out
    return Timed(forward, train_step, optimizer)


def compiled(model: nn.Module, batch: Batch) -> Timed:
    """torch.compile(mode="reduce-overhead") of the whole network (on the CPU dry run the
    "aot_eager" backend: the same tracing without code generation), the optimizer eager.
    Compiling happens in the first call of each, which the record keeps as its first-call
    time."""
    on_cuda = batch.device.type == "cuda"
    net = torch.compile(model, mode="reduce-overhead") if on_cuda else torch.compile(
        model, backend="aot_eager")
    optimizer = batch.work.optimizer(model.parameters())
    # each call is one step of the compiled graphs' replays: outputs of the last are free
    begin = torch.compiler.cudagraph_mark_step_begin if on_cuda else (lambda: None)

    def train_step() -> None:
        begin()
        optimizer.zero_grad(set_to_none=True)
        _step(net, optimizer, batch, batch.x, batch.y)

    def forward() -> Tensor:
        begin()
        with torch.no_grad():
            return net(batch.x)
    return Timed(forward, train_step, optimizer,
                 {"compile": "mode=reduce-overhead" if on_cuda else "backend=aot_eager"})


def mgrit_captured_step(model: nn.Module, batch: Batch) -> Timed:
    """MGRIT's whole training step (fixed cycle counts, forward and adjoint solves,
    parameter gradients and the optimizer update) as `mgrit.nn.CapturedStep`, and its
    no-grad forward pass (opening, forward solve, closing) as `mgrit.nn.CapturedForward`:
    each one CUDA graph on one rank, captured at its third call and replayed from then on."""
    from mgrit.nn import CapturedForward, CapturedStep

    optimizer = batch.work.optimizer(model.parameters())
    if batch.device.type == "cuda":
        # on a CPU the same static-buffer step runs eagerly, and torch's capturable
        # optimizers refuse CPU parameters
        optimizer = capturable(optimizer)
    step = CapturedStep(model, batch.work.loss, optimizer, batch.x, batch.y, check=False)
    forward_pass = CapturedForward(model, batch.x, check=False)
    notes: dict[str, Any] = {}

    def train_step() -> Tensor:
        loss = step.step(batch.x, batch.y)
        notes["captures"] = step.captures
        return loss

    def forward() -> Tensor:
        out = forward_pass(batch.x)
        notes["forward_captures"] = forward_pass.captures
        return out
    return Timed(forward, train_step, optimizer, notes)


def mgrit_network(**options: Any) -> Callable[[TrainingWorkload], nn.Module]:
    """The layer-parallel model with `options` in both its solvers' settings."""
    return lambda work: parallel_model(work.with_solver(**options))


def one_level_network(work: TrainingWorkload) -> nn.Module:
    return parallel_model(sequential_variant(work))


# in the order of the table, the baseline first (the `early` ones are timed first);
# "serial pytorch, cuda graph" and the mgrit names are those of docs/results/gpu-h200.json
METHODS = [
    Method("serial pytorch, cuda graph", serial_network, one_graph, exact=True,
           cuda_only=True, early=True),
    Method("serial pytorch", serial_network, eager, exact=True),
    Method("mgrit levels=1", one_level_network, eager, exact=True),
    Method("mgrit batched", mgrit_network(execution="batched"), eager, exact=False),
    Method("mgrit cuda graphs", mgrit_network(execution="batched", cuda_graphs=True), eager,
           exact=False),
    # graphs inside the captured step cannot nest: its own capture takes the whole step
    Method("mgrit captured step", mgrit_network(execution="batched"), mgrit_captured_step,
           exact=False, early=True),
    # the cheapest kind of setting `choose_settings` picks on the CPU where the error
    # allows: 2 levels, no cycle from nested starts (its update error is recorded beside it)
    Method("mgrit captured step, no cycle", mgrit_network(
        execution="batched", levels=2, coarsening=16, relax="F", min_coarse=1, max_iter=0,
        initial_guess="nested"), mgrit_captured_step, exact=False, early=True),
]
COMPILED = Method("torch.compile reduce-overhead", serial_network, compiled, exact=True)
ALL_METHODS = METHODS + [COMPILED]


# Checks and timing ----------------------------------------------------------------------

def _flat(tensors: Any) -> Tensor:
    return torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors])


def serial_parameters(model: nn.Module) -> Tensor:
    """The model's parameters in the plain network's order (a layer-parallel model's
    through its export)."""
    to_serial = getattr(model, "to_serial", None)
    return _flat((to_serial() if to_serial is not None else model).parameters())


@dataclass
class Reference:
    """Serial eager PyTorch from the common initial weights: its no-grad output, and its
    parameters before and after one training step."""

    output: Tensor
    before: Tensor
    after: Tensor


def reference(batch: Batch) -> Reference:
    model = serial_network(batch.work).to(batch.device)
    timed = eager(model, batch)
    output = timed.forward().detach().double().cpu()
    before = serial_parameters(model)
    timed.train_step()
    return Reference(output, before, serial_parameters(model))


class Reset:
    """Puts a model back to its initial weights and its optimizer to a fresh state, in
    place (captured graphs keep reading the same memory): a zeroed momentum or moment
    gives the same first step as none."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.initial = [p.detach().clone() for p in model.parameters()]

    def __call__(self, optimizer: torch.optim.Optimizer | None) -> None:
        with torch.no_grad():
            for p, p0 in zip(self.model.parameters(), self.initial):
                p.copy_(p0)
            for state in (optimizer.state.values() if optimizer is not None else ()):
                for value in state.values():
                    if isinstance(value, Tensor):
                        value.zero_()


def _relative(a: Tensor, b: Tensor) -> float:
    return float((a.double().cpu() - b).norm() / b.norm())


def event_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of one call, timed with CUDA events on an idle queue after two
    untimed calls (storage, graphs, library handles)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


# the host's launch calls, as the profiler names them
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


def device_activity(intervals_us: list[tuple[float, float]]) -> dict[str, float]:
    """The GPU operations' (start, end) in microseconds, as the seconds they took together
    and the seconds in which any ran (operations overlapping on concurrent streams or graph
    branches count once). Over the call's time, the second says how much of it the GPU
    worked (the rest: launch gaps and waits), and the first over the second how many
    operations ran at once on average: what the layer-parallel work gets of the device."""
    total = busy = 0.0
    reach = float("-inf")
    for start, end in sorted(intervals_us):
        total += end - start
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return {"device_op_seconds": total / 1e6, "device_busy_seconds": busy / 1e6}


def launches(fn: Callable[[], object]) -> dict[str, Any]:
    """Launch calls made by the host, and operations run by the GPU and their times
    (`device_activity`), in one call of fn."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    host: dict[str, int] = {}
    spans = []
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            spans.append((event.time_range.start, event.time_range.end))
        elif event.name in LAUNCH_CALLS:
            host[event.name] = host.get(event.name, 0) + 1
    return {"host_launches": sum(host.values()), "device_ops": len(spans), "by_call": host,
            **device_activity(spans)}


def measure(method: Method, name: str, batch: Batch, ref: Reference, repeats: int,
            record: Callable[[dict[str, Any]], None]) -> None:
    """Build, check and time one method on one workload; each metric's record goes to
    `record` as soon as it is measured."""
    base = {"workload": name, "method": method.name}
    if method.cuda_only and batch.device.type != "cuda":
        raise NotAvailable("needs a CUDA device")
    model = method.network(batch.work).to(batch.device)
    reset = Reset(model)
    timed = method.prepare(model, batch)
    on_cuda = batch.device.type == "cuda"
    for metric in METRICS:
        fn = getattr(timed, metric)
        if fn is None:
            record({**base, "metric": metric, "status": "not available",
                    "reason": f"the method gives no {metric.replace('_', ' ')}"})
            continue
        reset(timed.optimizer)
        start = time.perf_counter()
        out = fn()
        _sync(batch.device)
        first = time.perf_counter() - start
        if metric == "forward":
            error = _relative(out, ref.output)
        else:
            error = float((serial_parameters(model) - ref.after).norm()
                          / (ref.after - ref.before).norm())
        # a slow call (the stream executor, eager deep networks) gets fewer repeats; the
        # second call says which (the first may have compiled or captured)
        start = time.perf_counter()
        fn()
        _sync(batch.device)
        n = repeats if time.perf_counter() - start < 0.25 or repeats <= 3 else 3
        seconds = (event_seconds(fn, n) if on_cuda else median_seconds(fn, n))
        rec = {**base, "metric": metric, "status": "measured", "seconds": seconds,
               "repeats": n, "first_call_seconds": first, "exact": method.exact,
               ("forward_error" if metric == "forward" else "update_error"): error,
               **timed.notes}
        if on_cuda:
            try:
                rec.update(launches(fn))
            except Exception as exc:   # the time is kept without the count
                rec.update(host_launches=None, device_ops=None, launches_error=repr(exc))
        record(rec)
        print(f"  {name:>4} {metric:>10} {method.name:>30}: {seconds * 1e3:10.3f} ms"
              f" (first call {first:.2f} s, {'output' if metric == 'forward' else 'update'}"
              f" vs serial {error:.1e})", flush=True)


# The report ------------------------------------------------------------------------------

def slug(device_name: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `h100-80gb-hbm3`: the results file's name part."""
    words = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-").split("-")
    return "-".join(w for w in words if w != "nvidia") or "gpu"


class Report:
    """DIR/gpu-<device>.json and .md: rewritten whole (written, then renamed) after every
    record, so a run cut off keeps what it measured."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, Any]:
        return json.loads(self.path.read_text())

    def save(self, data: dict[str, Any]) -> None:
        data["targets"] = verdicts(data)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        tmp.replace(self.path)
        self.path.with_suffix(".md").write_text(table(data))

    def add(self, rec: dict[str, Any]) -> None:
        data = self.load()
        data["speed" if rec["status"] == "measured" else "unmeasured"].append(rec)
        self.save(data)


def _recorded(data: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(r["workload"], r["method"], r["metric"])
            for r in data["speed"] + data["unmeasured"]}


# What the captured step is for on one GPU: (workload, metric, bound, strict), its time at
# most `bound` times serial PyTorch's in one CUDA graph (below it, where strict)
TARGETS = (("w2", "train_step", 0.25, False), ("w2b", "train_step", 0.25, False),
           ("w2", "forward", 0.2, False), ("w4", "train_step", 1.0, True))
BASELINE = "serial pytorch, cuda graph"
CAPTURED = ("mgrit captured step", "mgrit captured step, no cycle")


def verdicts(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target for each captured method, from the record's times: the method's time
    over the baseline's (`ratio`), its difference from serial eager's step (`error`) and
    whether that meets the target (`met`); `met` is None (not judged) where either time
    is missing, with the reason the record gives. A record without statuses (an older
    one) counts every time it holds as measured."""
    rows = {(r["workload"], r["method"], r["metric"]): r
            for r in data.get("unmeasured", []) + data["speed"]}
    out = []
    for workload, metric, bound, strict in TARGETS:
        base = rows.get((workload, BASELINE, metric))
        for method in CAPTURED:
            mine = rows.get((workload, method, metric))
            verdict: dict[str, Any] = {"workload": workload, "metric": metric,
                                       "method": method, "bound": bound, "strict": strict,
                                       "ratio": None, "error": None, "met": None}
            missing = [(name, r) for name, r in ((BASELINE, base), (method, mine))
                       if r is None or r.get("status", "measured") != "measured"]
            if missing:
                name, r = missing[0]
                verdict["reason"] = (f"{name}: {r['status']}, {r.get('reason', '')}".strip(", ")
                                     if r else f"{name}: not timed in this run")
            else:
                verdict["ratio"] = mine["seconds"] / base["seconds"]
                verdict["error"] = mine.get("forward_error" if metric == "forward"
                                            else "update_error")
                verdict["met"] = (verdict["ratio"] < bound if strict
                                  else verdict["ratio"] <= bound)
            out.append(verdict)
    return out


def targets_table(data: dict[str, Any]) -> str:
    """The markdown table of `verdicts`: each target with each captured method's ratio,
    its difference from serial eager's step and whether it meets the target."""
    lines = ["| target | method | vs one CUDA graph | vs serial step | verdict |",
             "|---|---|---|---|---|"]
    for k, v in enumerate(verdicts(data)):
        bound = (f"below {v['bound']:g}x" if v["strict"] else f"at most {v['bound']:g}x")
        target = (f"{v['workload']} {v['metric'].replace('_', ' ')} {bound}"
                  if k % len(CAPTURED) == 0 else "")
        if v["met"] is None:
            cells = ["-", "-", f"not judged ({v['reason'][:120]})"]
        else:
            cells = [f"{v['ratio']:.2f}",
                     "-" if v["error"] is None else f"{v['error']:.1e}",
                     "met" if v["met"] else "not met"]
        lines.append("| " + " | ".join([target, v["method"], *cells]) + " |")
    return "\n".join(lines)


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def speed_table(data: dict[str, Any]) -> str:
    """The markdown table of the times: per workload and metric, the methods in
    `ALL_METHODS` order, each time against the first measured one (the strongest
    baseline) and serial eager."""
    lines = ["| workload | metric | method | time | vs first | vs eager | vs serial step "
             "| first call | launches | GPU ops | GPU busy | overlap |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {m.name: k for k, m in enumerate(ALL_METHODS)}
    for name in data["workloads"]:
        for metric in METRICS:
            rows = sorted((r for r in data["speed"] + data["unmeasured"]
                           if r["workload"] == name and r["metric"] == metric),
                          key=lambda r: order.get(r["method"], len(order)))
            measured = [r for r in rows if r["status"] == "measured"]
            first = measured[0]["seconds"] if measured else None
            eager_s = next((r["seconds"] for r in measured if r["method"] == "serial pytorch"),
                           None)
            for k, r in enumerate(rows):
                label = [name if k == 0 else "", metric.replace("_", " ") if k == 0 else "",
                         r["method"]]
                if r["status"] != "measured":
                    reason = str(r.get("reason", "")).strip().splitlines()
                    lines.append("| " + " | ".join(label + [
                        f"{r['status']}: {reason[-1][:120] if reason else ''}"] + [""] * 8)
                        + " |")
                    continue
                error = r.get("forward_error", r.get("update_error"))
                busy, ops = r.get("device_busy_seconds"), r.get("device_op_seconds")
                lines.append("| " + " | ".join(label + [
                    f"{r['seconds'] * 1e3:.3f} ms", f"{r['seconds'] / first:.2f}",
                    f"{r['seconds'] / eager_s:.3f}" if eager_s else "-",
                    f"{error:.1e}", f"{r['first_call_seconds']:.1f} s",
                    _count(r.get("host_launches")), _count(r.get("device_ops")),
                    f"{busy / r['seconds']:.0%}" if busy else "-",
                    f"{ops / busy:.2f}" if busy else "-"]) + " |")
    return "\n".join(lines)


def table(data: dict[str, Any]) -> str:
    """The report: the times (`speed_table`), then the targets (`targets_table`)."""
    env = data["environment"]
    return "\n".join([
        f"# mgrit on {env.get('gpu', env['device'])}", "",
        f"torch {env['torch']}, CUDA {env['torch_cuda']}, Python {env['python']}; median of "
        f"{data['settings']['repeats']} runs (at most 3 for calls over 0.25 s), "
        f"{'CUDA events' if env['device'] == 'cuda' else 'CPU timers (dry run)'}.", "",
        speed_table(data), "",
        "vs first: time over the first measured method's (serial PyTorch in one CUDA graph on "
        "a GPU); vs serial step: relative difference of the first output (forward) or of the "
        "first update (training step) from serial eager PyTorch's, from the same weights "
        "(exact methods: round-off); launches: the host's launch calls in one call; GPU ops: "
        "the operations the GPU ran; GPU busy: the part of the time in which any ran; "
        "overlap: their summed times over that (above 1: operations ran at once).", "",
        "## Targets", "",
        "The captured step's time over serial PyTorch's in one CUDA graph, for each captured "
        "setting; its difference from serial eager's step says what its speed costs in "
        "accuracy.", "",
        targets_table(data)]) + "\n"


def environment(device: torch.device) -> dict[str, Any]:
    from mgrit.app.environment import versions

    env = {**versions(), "torch_cuda": torch.version.cuda, "device": device.type,
           "cpus": os.cpu_count(), "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
    return env


# Jobs: one process per workload's methods, one per workload's compile --------------------

def run_job(kind: str, name: str, args: argparse.Namespace) -> int:
    """In a child process: every method of `kind` ("methods" or "compile") on workload
    `name`, each recorded in the report as soon as it is measured or fails."""
    device = torch.device(args.device)
    report = Report(args.report)
    small = device.type == "cpu"
    if small:   # the dry run's figures mean nothing; one thread keeps it quick when shared
        torch.set_num_threads(1)
    torch.manual_seed(0)
    work = workload(name, small)
    x, y = work.inputs(torch.Generator().manual_seed(1))
    batch = Batch(work, device, x.to(device), y.to(device))
    ref = reference(batch)
    methods = [COMPILED] if kind == "compile" else sorted(
        (m for m in METHODS if not m.only or name in m.only), key=lambda m: not m.early)
    failed = 0
    for method in methods:
        try:
            measure(method, name, batch, ref, args.repeats, report.add)
        except NotAvailable as why:
            for metric in METRICS:
                report.add({"workload": name, "method": method.name, "metric": metric,
                            "status": "not available", "reason": str(why)})
        except Exception:
            failed += 1
            text = traceback.format_exc()
            print(text, file=sys.stderr, flush=True)
            done = _recorded(report.load())
            for metric in METRICS:
                if (name, method.name, metric) not in done:
                    report.add({"workload": name, "method": method.name, "metric": metric,
                                "status": "failed", "reason": text})
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 1 if failed else 0


def jobs(args: argparse.Namespace) -> list[tuple[str, str, list[Method]]]:
    """(kind, workload, its methods) in the order they run: all methods of every workload,
    then the compiles, cheapest first."""
    out = [("methods", w, [m for m in METHODS if not m.only or w in m.only])
           for w in args.workloads]
    out += [("compile", w, [COMPILED]) for w in args.compile]
    return out


def _mark(report: Report, name: str, methods: list[Method], status: str, reason: str) -> None:
    """Record whatever of `methods` on `name` a job left unrecorded."""
    data = report.load()
    done = _recorded(data)
    for method in methods:
        for metric in METRICS:
            if (name, method.name, metric) not in done:
                data["unmeasured"].append({"workload": name, "method": method.name,
                                           "metric": metric, "status": status,
                                           "reason": reason})
    report.save(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the dry run (small workloads, CPU timers)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--compile", default=None,
                        help="the workloads torch.compile is timed on, in this order, last "
                             "(default w1,w2,w2b,w4; on the CPU w2)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per metric (default 5 on a GPU, 1 on the CPU)")
    parser.add_argument("--budget", type=float, default=230.0,
                        help="seconds for the whole run: no job starts past it")
    parser.add_argument("--job-limit", type=float, default=120.0,
                        help="seconds one workload's methods may take")
    parser.add_argument("--compile-limit", type=float, default=90.0,
                        help="seconds one workload's torch.compile run may take")
    parser.add_argument("--job", help=argparse.SUPPRESS)        # KIND:WORKLOAD, in a child
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile is None:
        args.compile = "w1,w2,w2b,w4" if args.device == "cuda" else "w2"
    for option in ("workloads", "compile"):
        names = [w for w in getattr(args, option).split(",") if w]
        unknown = [w for w in names if w not in WORKLOADS]
        if unknown:
            parser.error(f"--{option}: unknown workload(s) {unknown}; choose from "
                         f"{list(WORKLOADS)}")
        setattr(args, option, names)
    if args.repeats is None:
        args.repeats = 5 if args.device == "cuda" else 1
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"error: torch {torch.__version__} sees no CUDA device (CUDA build: "
              f"{torch.version.cuda}); run this on a machine with an NVIDIA GPU and a CUDA "
              "build of torch, or pass --device cpu for a dry run", file=sys.stderr)
        return 2
    # float32 as float32 on every method (the update checks compare against eager's)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.job:
        kind, name = args.job.split(":")
        return run_job(kind, name, args)
    return run_all(args)


def run_all(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    env = environment(device)
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out / f"gpu-{slug(env.get('gpu', 'cpu'))}.json")
    small = device.type == "cpu"
    report.save({"environment": env, "workloads": {
                     w: workload(w, small).description for w in dict.fromkeys(
                         args.workloads + args.compile)},
                 "settings": {"repeats": args.repeats, "budget": args.budget,
                              "job_limit": args.job_limit, "compile_limit": args.compile_limit,
                              "small": small, "deep_w4_blocks": DEEP_W4_BLOCKS},
                 "jobs": [], "speed": [], "unmeasured": []})
    print("environment: " + json.dumps(env), flush=True)
    deadline = time.monotonic() + args.budget
    failed = False
    for kind, name, methods in jobs(args):
        left = deadline - time.monotonic()
        nominal = args.compile_limit if kind == "compile" else args.job_limit
        limit = min(nominal, left)
        if left < min(nominal, 10):     # too little to start a process and build a model
            _mark(report, name, methods, "skipped", f"the run's budget of {args.budget:.0f} s "
                  "was spent before this job")
            continue
        print(f"{kind} {name} (limit {limit:.0f} s):", flush=True)
        command = [sys.executable, str(Path(__file__).resolve()), "--job", f"{kind}:{name}",
                   "--report", str(report.path), "--device", args.device,
                   "--repeats", str(args.repeats)]
        start = time.monotonic()
        try:
            status = subprocess.run(command, timeout=limit).returncode
            outcome = ("failed", f"the job's process ended with exit status {status} "
                       "before recording it")
        except subprocess.TimeoutExpired:
            status = None
            outcome = ("timed out", f"not done within the job's limit of {limit:.0f} s")
        data = report.load()
        data["jobs"].append({"kind": kind, "workload": name, "exit": status,
                             "seconds": time.monotonic() - start, "limit": limit})
        report.save(data)
        _mark(report, name, methods, *outcome)
        bad = [r for r in report.load()["unmeasured"] if r["workload"] == name
               and r["status"] in ("failed", "timed out") and r["method"] != COMPILED.name]
        failed = failed or bool(bad)
    print(report.path.with_suffix(".md").read_text(), flush=True)
    print(f"results: {report.path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
