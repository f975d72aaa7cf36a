"""Predicted speedups past this machine (DESIGN.md section 7, docs/scaling.md).

Layer-parallel training runs for P virtual ranks in one process (`mgrit.comm.virtual.run_ranks`):
the real `LayerParallel` code, one thread per rank, one rank at a time, each rank's compute
measured as its thread's CPU time between communication calls. In W1 the convolutions are
charged from a cost table measured here instead of computed (`KernelCosts`), so that 1024
conv layers need not be computed again for every P; everything else runs. The traces are
replayed on a modelled network (`mgrit.app.replay.replay`). Serial PyTorch and layer-wise model
parallelism are modelled from measured per-layer costs of the plain network and replayed
the same way. `study` checks the model against 1 and 2 real MPI ranks first.

    python -m benchmarks.scaling OUT_DIR      writes OUT_DIR/scaling.json and OUT_DIR/scaling.png
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import json
import logging
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mgrit.app.launch import mpiexec
from mgrit.app.replay import Event, Interconnect, Prediction, replay
from mgrit.comm import Comm
from mgrit.comm.mpi import MPIComm
from mgrit.comm.tracing import Tracer, TracingComm
from mgrit.comm.virtual import run_ranks
from mgrit.core.cycle import solve
from mgrit.kernels.choice import torch_kernels
from mgrit.nn import LayerParallel, serial_resnet

from . import workloads as models
from .bench import w0_case
from .training import WORKLOADS, Workload, _forward_fn, _step_fn

log = logging.getLogger(__name__)
T = TypeVar("T")

RANKS = [2 ** k for k in range(1, 11)]
# An assumed cluster interconnect (InfiniBand-class MPI: a few microseconds, ~10 GB/s); the
# per-message CPU overhead is this implementation's, measured on this machine.
CLUSTER_LATENCY, CLUSTER_BANDWIDTH = 5e-6, 10e9
LITERATURE_SPEEDUP = 10.2   # Kirby et al. 2020, over layer-wise model parallelism, GPUs


@dataclass(frozen=True)
class Case:
    """A training workload of bench_train at `num_steps` layers. `costed`: in virtual runs
    convolutions are charged from a cost table instead of computed. `levels`: a
    different MGRIT hierarchy depth (F-relaxation on the fine level, FCF below). `repeats`:
    traced training steps per virtual run; `processes`: virtual runs per point, each in a
    fresh process (the prediction is the fastest of all)."""

    name: str
    workload: str
    num_steps: int
    costed: bool
    levels: int | None = None
    repeats: int = 3
    processes: int = 1

    def work(self, num_steps: int | None = None) -> Workload:
        n = self.num_steps if num_steps is None else num_steps
        builder = {"w1": models.w1, "w2": models.w2}[self.workload]
        work = replace(WORKLOADS[self.workload](), network=lambda: builder(num_steps=n))
        if self.levels is None:
            return work
        relax = ("F",) + ("FCF",) * (self.levels - 2)
        return replace(work, forward=replace(work.forward, levels=self.levels, relax=relax),
                       backward=replace(work.backward, levels=self.levels, relax=relax))


CURVES = {"w2": Case("w2", "w2", 1024, costed=False, repeats=3, processes=3),
          "w1-1024": Case("w1-1024", "w1", 1024, costed=True, repeats=1)}
CHECKS = {"w2": CURVES["w2"], "w1": Case("w1", "w1", 32, costed=True, processes=2)}
W0_PROCESSES = 3
# validation runs launched per rank count, alternating 1 and 2 ranks: a 2-rank run needs both
# cores of the machine and is the first to suffer when something else takes one
VALIDATION_LAUNCHES = 3


# Building and running the model ----------------------------------------------------------

def _setup(work: Workload, seed: int = 0
           ) -> tuple[models.ResNetSpec, list[nn.Module], Tensor, Tensor]:
    """The network, its layers (built in serial order, as every rank would) and a batch."""
    torch.manual_seed(seed)
    net = work.network()
    layers = [net.step() for _ in range(net.num_steps)]
    x, y = work.inputs(torch.Generator().manual_seed(1))
    return net, layers, x, y


def _model(work: Workload, net: models.ResNetSpec, layers: list[nn.Module], comm: Any
           ) -> LayerParallel:
    """A LayerParallel whose step factory hands out `layers` in order (so virtual ranks
    share one set of initial weights instead of each drawing all of them again)."""
    given = iter(layers)
    return LayerParallel(lambda: next(given), net.num_steps, net.t_final, work.forward,
                         work.backward, comm=comm, opening=copy.deepcopy(net.opening),
                         closing=copy.deepcopy(net.closing))


def _train_step(model: nn.Module, work: Workload, x: Tensor, y: Tensor,
                tracer: Tracer | None = None) -> Callable[[], None]:
    """One optimiser step; the tracer (if any) marks "forward" when the output is there."""
    return _step_fn(model, work, x, y, None if tracer is None else lambda: tracer.mark("forward"))


class KernelCosts:
    """Convolutions charged instead of computed, in virtual ranks that `attach` a tracer.

    While the context is entered, `torch.nn.functional.conv2d` and
    `torch.nn.grad.conv2d_weight` called from such a rank charge the tracer the CPU time of
    the real call, from a table keyed by the call's shapes. An entry is the median of real
    calls made in place: at the first `first` calls of each kind and every `every`-th call
    after, the real kernel runs twice and the second run is timed (the first brings its code
    and data into cache, where a rank running the real network would have them). Samples
    spread over the whole study, so no burst of machine noise sets a price. The other calls
    return a stand-in at once. Callers without a tracer, and calls
    the table cannot shape, run the real kernel.

    The stand-in must not change what the solver does: a convolution returns 0.5 x + 0.25
    when it keeps the shape of its input x, 0.25 everywhere otherwise, so states stay
    nonzero and depend on the input nonlinearly through the activations, and a
    zero-tolerance solve runs all of its cycles; the adjoint skips exactly the rows it would
    skip (all-zero cotangents never reach a kernel). Weight gradients are zeros.
    `calls` counts the charged calls.
    """

    def __init__(self, first: int = 5, every: int = 50) -> None:
        self.first, self.every = first, every
        self.samples: dict[tuple, list[float]] = {}
        self.table: dict[tuple, float] = {}
        self.calls = 0
        self._local = threading.local()
        self._real: dict[str, Callable[..., Tensor]] = {}

    def attach(self, tracer: Tracer) -> None:
        self._local.tracer = tracer

    def __enter__(self) -> "KernelCosts":
        # the layer kernels' convolutions go through the functions replaced here, not
        # through the native kernels
        self._torch = torch_kernels()
        self._torch.__enter__()
        self._real = {"conv2d": F.conv2d, "conv2d_weight": torch.nn.grad.conv2d_weight}
        F.conv2d = self._conv2d
        torch.nn.grad.conv2d_weight = self._conv2d_weight
        return self

    def __exit__(self, *exc: object) -> None:
        F.conv2d = self._real["conv2d"]
        torch.nn.grad.conv2d_weight = self._real["conv2d_weight"]
        self._torch.__exit__(*exc)

    def _charge(self, key: tuple, real: Callable[[], Tensor], stand_in: Callable[[], Tensor]
                ) -> Tensor:
        tracer: Tracer = self._local.tracer
        tracer.enter()
        samples = self.samples.setdefault(key, [])
        self.calls += 1
        if len(samples) < self.first or self.calls % self.every == 0:
            real()  # brings the kernel's code and data back into cache, as back-to-back calls have them
            start = time.thread_time()
            out = real()
            samples.append(time.thread_time() - start)
            self.table[key] = statistics.median(samples)
        else:
            out = stand_in()
        tracer.charge(self.table[key])
        return out

    def _conv2d(self, input: Tensor, weight: Tensor, bias: Tensor | None = None,
                stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1
                ) -> Tensor:
        real = lambda: self._real["conv2d"](input, weight, bias, stride, padding,  # noqa: E731
                                            dilation, groups)
        shape = _conv_shape(input, weight, stride, padding, dilation)
        if getattr(self._local, "tracer", None) is None or shape is None or groups != 1:
            return real()
        key = ("conv2d", tuple(input.shape), tuple(weight.shape), bias is not None,
               str(stride), str(padding), str(dilation))
        return self._charge(key, real, lambda: (input.mul(0.5).add_(0.25) if input.shape == shape
                                                else input.new_full(shape, 0.25)))

    def _conv2d_weight(self, input: Tensor, weight_size: Any, grad_output: Tensor,
                       stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1
                       ) -> Tensor:
        real = lambda: self._real["conv2d_weight"](  # noqa: E731
            input, weight_size, grad_output, stride, padding, dilation, groups)
        if getattr(self._local, "tracer", None) is None:
            return real()
        key = ("conv2d_weight", tuple(input.shape), tuple(weight_size), str(stride),
               str(padding), str(dilation), groups)
        return self._charge(key, real, lambda: grad_output.new_zeros(tuple(weight_size)))

    def describe(self) -> list[dict[str, Any]]:
        """The table: each call kind with its arguments' shapes and settings, its price and
        the number of real calls measured."""
        return [{"call": k[0], "arguments": [str(a) for a in k[1:]], "seconds": v,
                 "samples": len(self.samples[k])} for k, v in self.table.items()]


def _conv_shape(input: Tensor, weight: Tensor, stride: Any, padding: Any, dilation: Any
                ) -> tuple[int, ...] | None:
    """Output shape of a 2-D convolution, or None for a padding given by name other than
    'same'/'valid' with stride 1."""
    pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
    if padding == "same":
        return (*input.shape[:-3], weight.shape[0], *input.shape[-2:])
    pad = (0, 0) if padding == "valid" else pair(padding)
    if isinstance(pad[0], str):
        return None
    size = [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n, p, d, k, s in
            zip(input.shape[-2:], pad, pair(dilation), weight.shape[-2:], pair(stride))]
    return (*input.shape[:-3], weight.shape[0], *size)


def fastest(times: Iterable[float]) -> float:
    """The time of a repeated measurement: the fastest repeat. On a shared machine slow
    phases (up to twice the time, lasting from milliseconds to seconds) come and go; the
    lower envelope is what repeats from run to run, and every time here, measured or
    predicted, is taken the same way."""
    return min(times)


def _cpu_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return fastest(times)


# Virtual ranks ---------------------------------------------------------------------------

def virtual_traces(case: Case, ranks: int, repeats: int = 3, warmup: int = 3,
                   kernels: KernelCosts | None = None) -> list[list[list[Event]]]:
    """Traces [repeat][rank] of training steps of `case` on `ranks` virtual ranks, after
    `warmup` untraced steps; with `kernels`, convolutions are charged from its table."""
    work = case.work()
    net, layers, x, y = _setup(work)

    def program(comm: Comm) -> list[list[Event]]:
        tracer = Tracer(time.thread_time)
        if kernels is not None:
            kernels.attach(tracer)
        model = _model(work, net, layers, TracingComm(comm, tracer))
        step = _train_step(model, work, x, y, tracer)
        for _ in range(warmup):
            step()
        traces = []
        for _ in range(repeats):
            tracer.start()
            step()
            traces.append(tracer.stop())
        return traces

    with kernels or contextlib.nullcontext():
        by_rank = run_ranks(ranks, program)
    return [[by_rank[r][k] for r in range(ranks)] for k in range(repeats)]


def virtual_solve_traces(ranks: int, repeats: int = 7, warmup: int = 10
                         ) -> list[list[list[Event]]]:
    """Traces [repeat][rank] of W0's distributed solve on virtual ranks, after `warmup`
    untraced solves (a solve takes milliseconds; a fresh process needs a few to settle)."""
    case = w0_case()

    def program(comm: Comm) -> list[list[Event]]:
        tracer = Tracer(time.thread_time)
        traced = TracingComm(comm, tracer)
        run = lambda: solve(case.prop, case.u0, case.num_steps, case.t0, case.t1,  # noqa: E731
                            case.config, comm=traced)
        for _ in range(warmup):
            run()
        traces = []
        for _ in range(repeats):
            tracer.start()
            run()
            traces.append(tracer.stop())
        return traces

    by_rank = run_ranks(ranks, program)
    return [[by_rank[r][k] for r in range(ranks)] for k in range(repeats)]


def predict(traces: list[list[list[Event]]], network: Interconnect) -> dict[str, Any]:
    """The fastest replayed step time over repeats and of the "forward" mark, with the
    critical path of the fastest repeat."""
    preds = sorted((replay(t, network) for t in traces), key=lambda p: p.total)
    best: Prediction = preds[0]
    out = {"seconds": best.total, "critical": best.critical,
           "busy_mean": statistics.fmean(best.busy)}
    if "forward" in best.marks:
        out["forward_seconds"] = fastest(p.marks["forward"] for p in preds)
    return out


# Serial PyTorch and layer-wise model parallelism -------------------------------------------

def serial_costs(case: Case, depths: tuple[int, int], repeats: int = 3) -> dict[str, Any]:
    """Per-layer and fixed CPU seconds of serial PyTorch's training step phases (forward,
    backward, zero_grad + optimizer update) and of a no-grad forward, from timing the plain
    network at two depths: cost(n) = fixed + n * per_layer."""
    phases = {}
    for n in depths:
        work = case.work(n)
        torch.manual_seed(0)
        net = work.network()
        model = serial_resnet(net.step, net.num_steps, net.t_final, net.opening, net.closing)
        x, y = work.inputs(torch.Generator().manual_seed(1))
        opt = work.optimizer(model.parameters())
        times: dict[str, list[float]] = {"forward": [], "backward": [], "update": []}
        for k in range(repeats + 1):
            t0 = time.thread_time()
            opt.zero_grad()
            t1 = time.thread_time()
            loss = work.loss(model(x), y)
            t2 = time.thread_time()
            loss.backward()
            t3 = time.thread_time()
            opt.step()
            t4 = time.thread_time()
            if k:
                times["forward"].append(t2 - t1)
                times["backward"].append(t3 - t2)
                times["update"].append(t1 - t0 + t4 - t3)
        phases[n] = {k: fastest(v) for k, v in times.items()}
        phases[n]["inference"] = _cpu_time(_forward_fn(model, x), repeats)
    n1, n2 = depths
    costs: dict[str, Any] = {"depths": list(depths)}
    for phase in ("forward", "backward", "update", "inference"):
        per_layer = (phases[n2][phase] - phases[n1][phase]) / (n2 - n1)
        costs[phase] = {"per_layer": per_layer,
                        "fixed": max(phases[n1][phase] - n1 * per_layer, 0.0)}
    state = net.opening(x) if net.opening is not None else x
    costs["state_bytes"] = state.numel() * state.element_size()
    return costs


def serial_seconds(costs: dict[str, Any], num_steps: int, phases: tuple[str, ...]) -> float:
    return sum(costs[p]["fixed"] + num_steps * costs[p]["per_layer"] for p in phases)


def layerwise_traces(costs: dict[str, Any], num_steps: int, ranks: int, train: bool
                     ) -> list[list[Event]]:
    """Layer-wise model parallelism: contiguous blocks of layers, rank p computing its block
    after receiving rank p-1's output (and, training, its gradient part after rank p+1's
    gradient, then updating its own layers). Fixed costs (opening, closing, loss) go to the
    last rank. A no-grad forward (`train=False`) uses the inference costs."""
    size = costs["state_bytes"]
    base, extra = divmod(num_steps, ranks)
    traces = []
    for p in range(ranks):
        n = base + (1 if p < extra else 0)
        last = p == ranks - 1
        fwd = costs["forward" if train else "inference"]
        events: list[Event] = []
        if p > 0:
            events.append(["wait", p - 1, "activation", 0])
        events.append(["compute", n * fwd["per_layer"] + (fwd["fixed"] if last else 0.0)])
        if not last:
            events.append(["send", p + 1, size, "activation", 0])
        if train:
            bwd, upd = costs["backward"], costs["update"]
            if not last:
                events.append(["wait", p + 1, "gradient", 0])
            events.append(["compute", n * bwd["per_layer"] + (bwd["fixed"] if last else 0.0)])
            if p > 0:
                events.append(["send", p - 1, size, "gradient", 0])
            events.append(["compute", n * upd["per_layer"] + (upd["fixed"] if last else 0.0)])
        traces.append(events)
    return traces


# Real MPI runs: measured times and traces (1 and 2 ranks) -----------------------------------

def ping_pong(comm: Comm, sizes: tuple[int, int] = (8, 1 << 20), rounds: int = 400
              ) -> dict[str, float]:
    """Interconnect parameters between ranks 0 and 1 from half round trips of a small and a
    large message: overhead (CPU time of posting a send), latency, bandwidth."""
    half, posting = {}, []
    for n in sizes:
        buf = torch.zeros(n, dtype=torch.uint8)
        count = rounds if n < (1 << 16) else rounds // 8
        for timed in (False, True):
            start = time.perf_counter()
            for _ in range(count):
                if comm.rank == 0:
                    t = time.perf_counter()
                    req = comm.isend(buf, 1, 7)
                    posting.append(time.perf_counter() - t)
                    req.wait()
                    comm.irecv(buf, 1, 7).wait()
                elif comm.rank == 1:
                    comm.irecv(buf, 0, 7).wait()
                    comm.isend(buf, 0, 7).wait()
            if timed:
                half[n] = (time.perf_counter() - start) / (2 * count)
    small, large = sizes
    overhead = statistics.median(posting) if posting else 0.0
    return {"overhead": overhead, "latency": max(half[small] - overhead, 0.0),
            "bandwidth": (large - small) / max(half[large] - half[small], 1e-12),
            "half_round_trip_small": half[small], "half_round_trip_large": half[large]}


def _measured_and_traced(world: Any, plain: Callable[[], Any], traced: Callable[[], Any],
                         tracer: Tracer, repeats: int) -> dict[str, Any]:
    """Alternately a timed plain run (from a barrier to the last rank's end) and a traced
    run, `repeats` times after a first round that warms both up."""
    from mpi4py import MPI

    times, traces = [], []
    for k in range(repeats + 1):
        world.Barrier()
        start = time.perf_counter()
        plain()
        elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
        world.Barrier()
        tracer.start()
        traced()
        trace = tracer.stop()
        if k:
            times.append(elapsed)
            traces.append(trace)
    gathered = world.gather(traces, root=0)
    return {"measured": times,
            "traces": None if gathered is None else
            [[gathered[r][k] for r in range(world.size)] for k in range(repeats)]}


def validation_record(cases: tuple[str, ...] = ("w0", "w2", "w1"), repeats: int = 5
                      ) -> dict[str, Any] | None:
    """Under mpiexec (1 or 2 ranks): measured times and wall-clock traces of W0's solve and
    of training steps and no-grad forwards of CHECKS; a ping-pong on 2 ranks. The whole
    record on rank 0, None elsewhere."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    tracer = Tracer()
    traced_comm = TracingComm(MPIComm(world), tracer)
    record: dict[str, Any] = {"ranks": world.size}
    if world.size == 2:
        record["ping_pong"] = ping_pong(MPIComm(world))
    for name in cases:
        if name == "w0":
            c = w0_case()
            run = lambda comm: (lambda: solve(c.prop, c.u0, c.num_steps, c.t0, c.t1,  # noqa: E731
                                              c.config, comm=comm))
            record[name] = {"solve": _measured_and_traced(world, run(world), run(traced_comm),
                                                          tracer, repeats)}
            continue
        work = CHECKS[name].work()
        net, layers, x, y = _setup(work)
        plain = _model(work, net, layers, world)
        traced = _model(work, net, layers, traced_comm)
        record[name] = {
            "train": _measured_and_traced(world, _train_step(plain, work, x, y),
                                          _train_step(traced, work, x, y), tracer, repeats),
            "forward": _measured_and_traced(world, _forward_fn(plain, x), _forward_fn(traced, x),
                                            tracer, repeats)}
    return record if world.rank == 0 else None


def validation_worker(out: str) -> None:
    """Entry for `mpiexec -n P python -m mpi4py -c ...`: rank 0 writes the record to `out`."""
    record = validation_record()
    if record is not None:
        Path(out).write_text(json.dumps(record))


def _launch_validation(ranks: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        code = f"from benchmarks.scaling import validation_worker; validation_worker({str(out)!r})"
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-c", code]
        proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"),
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
        return json.loads(out.read_text())


def _measurements(record: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(case, metric, its measured times and traces) of a validation record."""
    for name, metrics in record.items():
        if isinstance(metrics, dict) and name != "ping_pong":
            for metric, data in metrics.items():
                yield name, metric, data


def merge_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Validation records of separate launches on the same rank count as one: the measured
    times and traces of every launch (the comparison takes the fastest of each), the first
    launch's ping-pong."""
    merged = copy.deepcopy(records[0])
    for record in records[1:]:
        for name, metric, data in _measurements(record):
            merged[name][metric]["measured"] += data["measured"]
            merged[name][metric]["traces"] += data["traces"]
    return merged


def network_from(ping: dict[str, float]) -> Interconnect:
    return Interconnect(latency=ping["latency"], bandwidth=ping["bandwidth"],
                   overhead=ping["overhead"])


def compare(record: dict[str, Any], network: Interconnect) -> list[dict[str, Any]]:
    """Measured (fastest repeat) against predicted from the record's own traces (fastest
    replay), for every case and metric of a validation record."""
    rows = []
    for name, metric, data in _measurements(record):
        measured = fastest(data["measured"])
        predicted = fastest(replay(t, network).total for t in data["traces"])
        rows.append({"case": name, "metric": metric, "ranks": record["ranks"],
                     "measured": measured, "predicted_from_mpi_traces": predicted,
                     "error": predicted / measured - 1.0})
    return rows


def fresh(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a newly spawned Python process. Every measurement starts from a clean
    heap, as a real rank's process does: a heap that earlier runs with large tensors left
    behind makes small-tensor code measurably (10-15%) slower."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def virtual_point(case: Case | None, ranks: int, networks: dict[str, Interconnect]
                  ) -> dict[str, Any]:
    """Predictions per network of a case's training step (None: W0's solve) on `ranks`
    virtual ranks, with the kernel table of a costed case."""
    kernels = KernelCosts() if case is not None and case.costed else None
    traces = (virtual_solve_traces(ranks) if case is None else
              virtual_traces(case, ranks, case.repeats, kernels=kernels))
    return {"predictions": {label: predict(traces, net) for label, net in networks.items()},
            "kernels": kernels.describe() if kernels is not None else []}


def _processes(case: Case | None) -> int:
    return W0_PROCESSES if case is None else case.processes


def fastest_points(jobs: list[tuple[Case | None, int]], networks: dict[str, Interconnect],
                   done: Callable[[Case | None, int, dict[str, Any], float], None] | None = None
                   ) -> list[dict[str, Any]]:
    """For every (case, ranks) job, `virtual_point` in `case.processes` fresh processes and
    per network the fastest prediction (step and forward pass each). The processes run in
    rounds (one process of every job per round) rather than job after job: the machine's slow
    phases last minutes, and a point whose processes all ran in one of them would carry it.
    `done(case, ranks, point, seconds)` is called as each job's last process ends."""
    runs: list[list[dict[str, Any]]] = [[] for _ in jobs]
    spent = [0.0] * len(jobs)
    for round_ in range(max((_processes(case) for case, _ in jobs), default=0)):
        for i, (case, ranks) in enumerate(jobs):
            if round_ < _processes(case):
                start = time.perf_counter()
                runs[i].append(fresh(virtual_point, case, ranks, networks))
                spent[i] += time.perf_counter() - start
                if done is not None and len(runs[i]) == _processes(case):
                    done(case, ranks, _fastest(runs[i], networks), spent[i])
    return [_fastest(points, networks) for points in runs]


def _fastest(points: list[dict[str, Any]], networks: dict[str, Interconnect]) -> dict[str, Any]:
    """Per network the fastest of several virtual runs' predictions (step and forward pass
    each)."""
    best = {}
    for label in networks:
        preds = [pt["predictions"][label] for pt in points]
        best[label] = dict(min(preds, key=lambda p: p["seconds"]))
        if "forward_seconds" in best[label]:
            best[label]["forward_seconds"] = fastest(p["forward_seconds"] for p in preds)
    return {"predictions": best, "kernels": points[-1]["kernels"]}


def virtual_checks(records: dict[int, dict[str, Any]], network: Interconnect
                   ) -> list[dict[str, Any]]:
    """The virtual-rank model against the measured times of the validation records."""
    rows = []
    jobs = [(ranks, name) for ranks, record in records.items()
            for name in ("w0", *CHECKS) if name in record]
    points = fastest_points([(CHECKS.get(name), ranks) for ranks, name in jobs],
                            {"": network})
    for (ranks, name), point in zip(jobs, points):
        pred = point["predictions"][""]
        pairs = ([("solve", pred["seconds"])] if name == "w0" else
                 [("train", pred["seconds"]), ("forward", pred["forward_seconds"])])
        for metric, predicted in pairs:
            measured = fastest(records[ranks][name][metric]["measured"])
            rows.append({"case": name, "metric": metric, "ranks": ranks,
                         "predicted_virtual": predicted,
                         "virtual_error": predicted / measured - 1.0})
    return rows


def curve(case: Case, ranks: list[int], networks: dict[str, Interconnect]
          ) -> list[dict[str, Any]]:
    """Predicted MGRIT times of one case per rank count and network (`add_baselines`
    completes the rows)."""
    def done(case: Case | None, p: int, point: dict[str, Any], seconds: float) -> None:
        last = list(point["predictions"].values())[-1]      # of the last network given
        log.info("%s, %d ranks: %.2f ms per training step (%.0f s)", case.name, p,
                 last["seconds"] * 1e3, seconds)

    rows = []
    for p, point in zip(ranks, fastest_points([(case, p) for p in ranks], networks, done)):
        for label in networks:
            pred = point["predictions"][label]
            rows.append({"case": case.name, "network": label, "ranks": p,
                         "num_steps": case.num_steps, "mgrit_train": pred["seconds"],
                         "mgrit_forward": pred["forward_seconds"],
                         "busy_mean": pred["busy_mean"], "critical": pred["critical"],
                         "kernels": point["kernels"]})
    return rows


def add_baselines(rows: list[dict[str, Any]], serial: dict[str, Any],
                  networks: dict[str, Interconnect]) -> None:
    """Serial and layer-wise model-parallel times, and the speedups, into curve rows."""
    for row in rows:
        n, p, network = row["num_steps"], row["ranks"], networks[row["network"]]
        serial_train = serial_seconds(serial, n, ("forward", "backward", "update"))
        serial_forward = serial_seconds(serial, n, ("inference",))
        mp_train = replay(layerwise_traces(serial, n, p, train=True), network).total
        mp_forward = replay(layerwise_traces(serial, n, p, train=False), network).total
        row.update({
            "serial_train": serial_train, "serial_forward": serial_forward,
            "layerwise_train": mp_train, "layerwise_forward": mp_forward,
            "speedup_vs_serial": serial_train / row["mgrit_train"],
            "speedup_vs_layerwise": mp_train / row["mgrit_train"],
            "forward_speedup_vs_serial": serial_forward / row["mgrit_forward"],
            "forward_speedup_vs_layerwise": mp_forward / row["mgrit_forward"]})


def fastest_serial(runs: list[dict[str, Any]], num_steps: int) -> dict[str, Any]:
    """Of several `serial_costs` runs, the one with the fastest training step at
    `num_steps` layers."""
    return min(runs, key=lambda c: serial_seconds(c, num_steps, ("forward", "backward",
                                                                 "update")))


# The study ---------------------------------------------------------------------------------

def validation() -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The ping-pong of 2 MPI ranks, and per case, metric and rank count (1, 2) the measured
    time (fastest of VALIDATION_LAUNCHES launches' repeats) against the replays of the MPI
    runs' own traces and of virtual-rank traces, on the network the ping-pong measured."""
    log.info("validation: measured and traced runs on 1 and 2 MPI ranks")
    launches: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for _ in range(VALIDATION_LAUNCHES):
        for p in launches:
            launches[p].append(_launch_validation(p))
    records = {p: merge_records(runs) for p, runs in launches.items()}
    network = network_from(records[2]["ping_pong"])
    rows = compare(records[1], network) + compare(records[2], network)
    virtual = {(r["case"], r["metric"], r["ranks"]): r for r in virtual_checks(records, network)}
    for row in rows:
        row.update(virtual[(row["case"], row["metric"], row["ranks"])])
    return records[2]["ping_pong"], rows


def study(ranks: list[int] | None = None, variant_ranks: tuple[int, ...] = (64, 256)
          ) -> dict[str, Any]:
    """Everything docs/scaling.md reports: validation on 1 and 2 MPI ranks, the measured
    network, serial costs, the predicted curves (W1 from 2 ranks: one rank would hold all
    1024 conv layers' states) and hierarchy-depth variants of W2. Every method computes
    with torch's kernels, no native convolutions or dense steps (the virtual ranks charge
    W1's convolutions from measurements of torch's), so that the ratios compare methods,
    not kernels."""
    with torch_kernels():
        return _study(ranks, variant_ranks)


def _study(ranks: list[int] | None, variant_ranks: tuple[int, ...]) -> dict[str, Any]:
    torch.set_num_threads(1)
    ranks = [1, *RANKS] if ranks is None else ranks
    ping, validation_rows = validation()
    shared = network_from(ping)
    cluster = Interconnect(CLUSTER_LATENCY, CLUSTER_BANDWIDTH, shared.overhead)
    networks = {"cluster": cluster, "shared memory": shared}
    depths = {"w2": (256, 1024), "w1-1024": (64, 128)}
    serial_runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CURVES}

    def measure_serial() -> None:
        # serial costs are measured between the curves, so that no slow phase of the
        # machine sets them; the fastest run counts
        log.info("serial PyTorch costs")
        for name, case in CURVES.items():
            serial_runs[name].append(fresh(serial_costs, case, depths[name]))

    measure_serial()
    curves, variants = [], []
    for name, case in CURVES.items():
        curves += curve(case, [p for p in ranks if p > 1 or not case.costed], networks)
        measure_serial()
    for levels in [n for n in (3, 4, 5) if n != CURVES["w2"].work().forward.levels]:
        case = replace(CURVES["w2"], name=f"w2-levels{levels}", levels=levels)
        variants += curve(case, list(variant_ranks), {"cluster": cluster})
    serial = {name: fastest_serial(runs, CURVES[name].num_steps)
              for name, runs in serial_runs.items()}
    for row in (*curves, *variants):
        name = next(n for n in CURVES if row["case"].startswith(n))
        add_baselines([row], serial[name], networks)
    cases = {c.name: {"workload": c.workload, "num_steps": c.num_steps, "costed": c.costed,
                      "repeats": c.repeats, "processes": c.processes, "description": c.work().description,
                      "forward": c.work().forward.describe(),
                      "backward": c.work().backward.describe()}
             for c in (*CURVES.values(), *CHECKS.values())}
    return {"cases": cases, "networks": {k: vars(v) for k, v in networks.items()},
            "ping_pong": ping, "validation": validation_rows, "serial_costs": serial,
            "serial_runs": serial_runs,
            "curves": curves, "variants": variants,
            "literature_speedup_vs_layerwise": LITERATURE_SPEEDUP, "convolutions": "torch",
            "torch": torch.__version__, "cpus": os.cpu_count()}


def plot(result: dict[str, Any], path: Path) -> None:
    """Predicted speedups of a training step against P, one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(11, 4.2), sharey=True)
    for ax, name in zip(axes, CURVES):
        for network, style in (("cluster", "-"), ("shared memory", ":")):
            rows = [r for r in result["curves"] if r["case"] == name and r["network"] == network]
            p = [r["ranks"] for r in rows]
            ax.plot(p, [r["speedup_vs_layerwise"] for r in rows], style, marker="o", ms=3,
                    color="C0", label=f"vs layer-wise model parallel ({network})")
            ax.plot(p, [r["speedup_vs_serial"] for r in rows], style, marker="s", ms=3,
                    color="C1", label=f"vs serial PyTorch ({network})")
        ax.axhline(LITERATURE_SPEEDUP, color="C3", lw=1, ls="--",
                   label="10.2x reported over layer-wise MP (GPUs)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks P (one core each)")
        ax.set_title(f"{name.upper()}: predicted training-step speedup")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("speedup")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_tables(result: dict[str, Any]) -> None:
    print("validation (seconds; error = predicted / measured - 1)")
    print(f"{'case':>6} {'metric':>8} {'P':>2} {'measured':>9} {'from MPI traces':>15} "
          f"{'error':>7} {'virtual ranks':>13} {'error':>7}")
    for r in result["validation"]:
        print(f"{r['case']:>6} {r['metric']:>8} {r['ranks']:>2} {r['measured']:9.4f} "
              f"{r['predicted_from_mpi_traces']:15.4f} {r['error']:+7.1%} "
              f"{r['predicted_virtual']:13.4f} {r['virtual_error']:+7.1%}")
    for name in (*CURVES, "variants"):
        rows = ([r for r in result["curves"] if r["case"] == name and r["network"] == "cluster"]
                if name != "variants" else result["variants"])
        print(f"\n{name}: predicted, cluster network (ms; speedups of a training step / of "
              "a forward pass)")
        print(f"{'case':>10} {'P':>5} {'MGRIT':>9} {'layer-wise':>10} {'serial':>9} "
              f"{'vs layer-wise':>13} {'vs serial':>9} {'fwd vs lw':>9} {'fwd vs serial':>13}")
        for r in rows:
            print(f"{r['case']:>10} {r['ranks']:>5} {r['mgrit_train'] * 1e3:9.2f} "
                  f"{r['layerwise_train'] * 1e3:10.2f} {r['serial_train'] * 1e3:9.2f} "
                  f"{r['speedup_vs_layerwise']:13.2f} {r['speedup_vs_serial']:9.2f} "
                  f"{r['forward_speedup_vs_layerwise']:9.2f} "
                  f"{r['forward_speedup_vs_serial']:13.2f}")


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m benchmarks.scaling OUT_DIR")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    result = study()
    (out / "scaling.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "scaling.png")
    print_tables(result)


if __name__ == "__main__":
    main(sys.argv[1:])
