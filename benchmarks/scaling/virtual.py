"""Layer-parallel training and W0's solve on P virtual ranks in one process
(`mgrit.comm.virtual.run_ranks`): the real `LayerParallel` and solver code, one thread per
rank, one rank at a time, each rank's compute measured as its thread's CPU time between
communication calls, and the traces replayed on a modelled `Interconnect`. In W1 the
convolutions are charged from a cost table measured here instead of computed
(`KernelCosts`), so that 1024 conv layers need not be computed again for every P.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import statistics
import threading
import time
from typing import Any, Callable, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from mgrit.app.replay import Event, Interconnect, Prediction, replay
from mgrit.comm import Comm
from mgrit.comm.tracing import Tracer, TracingComm
from mgrit.comm.virtual import run_ranks

from ..workloads import TrainingWorkload, w0_workload
from .cases import (W0_PROCESSES, ScalingCase, fastest, setup, shared_model, torch_kernels,
                    traced_step)

T = TypeVar("T")


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
            # brings the kernel's code and data back into cache, as back-to-back calls have them
            real()
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


def virtual_traces(case: ScalingCase, ranks: int, repeats: int = 3, warmup: int = 3,
                   kernels: KernelCosts | None = None) -> list[list[list[Event]]]:
    """Traces [repeat][rank] of training steps of `case` on `ranks` virtual ranks, after
    `warmup` untraced steps; with `kernels`, convolutions are charged from its table."""
    return work_traces(case.work(), ranks, repeats, warmup, kernels)


def work_traces(work: TrainingWorkload, ranks: int, repeats: int = 3, warmup: int = 3,
                kernels: KernelCosts | None = None) -> list[list[list[Event]]]:
    """`virtual_traces` of a training workload (any network and solver settings)."""
    built = setup(work)
    with kernels or contextlib.nullcontext():
        by_rank = run_ranks(ranks, lambda comm: rank_traces(work, built, comm, repeats, warmup,
                                                            kernels))
    return [[by_rank[r][k] for r in range(ranks)] for k in range(repeats)]


def rank_traces(work: TrainingWorkload, built: tuple, comm: Comm, repeats: int, warmup: int,
                kernels: KernelCosts | None = None) -> list[list[Event]]:
    """One rank's traces of `repeats` training steps on `comm`, after `warmup` untraced
    ones, its compute timed on its thread's CPU clock; `built`: what `setup(work)` gave."""
    net, layers, x, y = built
    tracer = Tracer(time.thread_time)
    if kernels is not None:
        kernels.attach(tracer)
    model = shared_model(work, net, layers, TracingComm(comm, tracer))
    return _repeat_traced(tracer, traced_step(model, work, x, y, tracer), repeats, warmup)


def _repeat_traced(tracer: Tracer, run: Callable[[], object], repeats: int, warmup: int
                   ) -> list[list[Event]]:
    """`run()` `warmup` times untraced, then `repeats` times, each one's trace kept."""
    for _ in range(warmup):
        run()
    traces = []
    for _ in range(repeats):
        tracer.start()
        run()
        traces.append(tracer.stop())
    return traces


def virtual_solve_traces(ranks: int, repeats: int = 7, warmup: int = 10
                         ) -> list[list[list[Event]]]:
    """Traces [repeat][rank] of W0's distributed solve on virtual ranks, after `warmup`
    untraced solves (a solve takes milliseconds; a fresh process needs a few to settle)."""
    work = w0_workload()

    def program(comm: Comm) -> list[list[Event]]:
        tracer = Tracer(time.thread_time)
        traced = TracingComm(comm, tracer)
        return _repeat_traced(tracer, lambda: work.solve(comm=traced), repeats, warmup)

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


def fresh(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a newly spawned Python process. Every measurement starts from a clean
    heap, as a real rank's process does: a heap that earlier runs with large tensors left
    behind makes small-tensor code measurably (10-15%) slower."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def virtual_point(case: ScalingCase | None, ranks: int, networks: dict[str, Interconnect]
                  ) -> dict[str, Any]:
    """Predictions per network of a case's training step (None: W0's solve) on `ranks`
    virtual ranks, with the kernel table of a costed case."""
    kernels = KernelCosts() if case is not None and case.costed else None
    traces = (virtual_solve_traces(ranks) if case is None else
              virtual_traces(case, ranks, case.repeats, case.warmup, kernels=kernels))
    return {"predictions": {label: predict(traces, net) for label, net in networks.items()},
            "kernels": kernels.describe() if kernels is not None else []}


def _processes(case: ScalingCase | None, processes: int | None = None) -> int:
    if processes is not None:
        return processes
    return W0_PROCESSES if case is None else case.processes


def fastest_points(jobs: list[tuple[ScalingCase | None, int]],
                   networks: dict[str, Interconnect],
                   done: Callable[[ScalingCase | None, int, dict[str, Any], float], None]
                   | None = None, processes: int | None = None) -> list[dict[str, Any]]:
    """For every (case, ranks) job, `virtual_point` in `case.processes` fresh processes (or
    `processes` for every job) and per network the fastest prediction (step and forward pass
    each). The processes run in rounds (one process of every job per round) rather than job
    after job: the machine's slow phases last minutes, and a point whose processes all ran
    in one of them would carry it. `done(case, ranks, point, seconds)` is called as each
    job's last process ends."""
    runs: list[list[dict[str, Any]]] = [[] for _ in jobs]
    spent = [0.0] * len(jobs)
    counts = [_processes(case, processes) for case, _ in jobs]
    for round_ in range(max(counts, default=0)):
        for i, (case, ranks) in enumerate(jobs):
            if round_ < counts[i]:
                start = time.perf_counter()
                runs[i].append(fresh(virtual_point, case, ranks, networks))
                spent[i] += time.perf_counter() - start
                if done is not None and len(runs[i]) == counts[i]:
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
