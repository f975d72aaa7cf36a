"""GPU check of mgrit's CUDA path (run by gpu_check.sh): correctness asserted, speed as
ratios measured in one run.

    python benchmarks/gpu_check.py [--out DIR] [--repeats N] [--device cuda|cpu]
                                   [--sections a,b,...]

Sections, each in its own process under its own time limit, written to DIR/gpu_check.json
as soon as it ends (a failing or stuck section is recorded and the others still run):
  kernels_vs_twins  each CUDA kernel against its pure-torch twin, max|kernel - twin| /
                    max|twin| (asserted: float64 <= 1e-12, float32 <= 1e-5)
  executors         the batched executor (also with CUDA graphs of its sweeps) and the
                    stream executor against the loop executor, and levels=1 against serial
                    PyTorch: W2 and W2b, float64 and float32, a no-grad forward and a whole
                    training step (output and every gradient; asserted)
  two_ranks         2 MPI ranks sharing the GPU (states and messages on the device, staged
                    through the host or CUDA-aware) against 1 rank: output, every gradient
                    and the forward and adjoint residual histories (asserted)
  speed             serial PyTorch (eager, and the whole step captured as a CUDA graph)
                    against mgrit levels=1 and MGRIT with batched relaxation, streams and
                    graphs: forward and training step of W2, W2b and W1, timed with CUDA
                    events, with the kernel launches of one step of each
  kernel_timing     kernels against their twins, B = 256 intervals, d = 32, S = 1 and 32
The exit status is 1 if any section failed, 2 without a CUDA device. `--device cpu` is a dry
run without a GPU: the CUDA-only parts are left out, the rest runs on the CPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

import mgrit
from mgrit.kernels import cuda as kernels

from benchmarks.timing import median_seconds
from benchmarks.training import build, forward_fn, sequential_variant, train_step_fn
from benchmarks.workloads import TRAINING_WORKLOADS, TrainingWorkload

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
# (B, S, d): the timing shapes, partial sample tiles, widths off the warp size, the
# one-sample path (a tile too wide for shared memory)
CHECK_SHAPES = [(256, 1, 32), (256, 32, 32), (5, 13, 40), (3, 9, 130), (2, 3, 800)]
TIMING_SHAPES = [(256, 1, 32), (256, 32, 32)]
KERNEL_CALLS = 100  # back-to-back calls per timed kernel repeat
# name -> (seconds it may take, whether it needs a GPU); run in this order, the assertions
# first, so that the minutes of a short visit go to what matters most
SECTIONS = {"kernels_vs_twins": (45, True), "executors": (90, False),
            "two_ranks": (90, False), "speed": (240, False), "kernel_timing": (30, True)}
# results against their twins' (relative to the twin's largest entry): a float32 training
# step goes through 1024 layers and three MGRIT cycles
EXECUTOR_TOLERANCE = {torch.float64: 1e-11, torch.float32: 1e-4}


def _problem(B: int, S: int, d: int, dtype: torch.dtype, device: torch.device
             ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(B * 10007 + S * 101 + d)
    tensors = {"u": torch.randn(B, S, d, generator=gen, dtype=dtype),
               "W": torch.randn(B, d, d, generator=gen, dtype=dtype) / d ** 0.5,
               "b": torch.randn(B, d, generator=gen, dtype=dtype),
               "g": torch.randn(B, S, d, generator=gen, dtype=dtype)}
    return {k: v.to(device) for k, v in tensors.items()}


def _pairs(p: dict[str, torch.Tensor], dt: float
           ) -> dict[str, tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]]:
    """kernel name -> (kernel call, twin call) on problem p."""
    u, W, b, g = p["u"], p["W"], p["b"], p["g"]
    return {"dense_step": (lambda: kernels.dense_step(u, W, b, dt),
                           lambda: kernels.dense_step_reference(u, W, b, dt)),
            "dense_step_vjp": (lambda: kernels.dense_step_vjp(u, W, b, g, dt),
                               lambda: kernels.dense_step_vjp_reference(u, W, b, g, dt))}


def kernels_vs_twins(device: torch.device, records: list[dict[str, Any]]) -> None:
    failures = []
    for dtype in TOLERANCE:
        for B, S, d in CHECK_SHAPES:
            p = _problem(B, S, d, dtype, device)
            views = {"contiguous": p, "every second layer": {k: v[::2] for k, v in p.items()}}
            for layout, q in views.items():
                for name, (kernel, twin) in _pairs(q, 0.25).items():
                    err = _relative_error(kernel(), twin())
                    ok = err <= TOLERANCE[dtype]
                    records.append({"kernel": name, "dtype": str(dtype), "B": len(q["u"]),
                                    "S": S, "d": d, "layout": layout,
                                    "max_relative_error": err, "ok": ok})
                    print(f"  {name:>15} {str(dtype):>13} B={len(q['u']):<4} S={S:<3} d={d:<4}"
                          f" {layout:>18}: max relative error {err:.2e}"
                          f"{'' if ok else f'  > {TOLERANCE[dtype]:.0e} FAILED'}")
                    if not ok:
                        failures.append(records[-1])
    if failures:
        raise AssertionError(f"{len(failures)} kernel results exceed the tolerance: {failures}")


def kernel_timing(device: torch.device, repeats: int, records: list[dict[str, Any]]) -> None:
    for dtype in TOLERANCE:
        for B, S, d in TIMING_SHAPES:
            for name, (kernel, twin) in _pairs(_problem(B, S, d, dtype, device), 0.25).items():
                k = median_seconds(kernel, repeats, torch.cuda.synchronize, KERNEL_CALLS)
                t = median_seconds(twin, repeats, torch.cuda.synchronize, KERNEL_CALLS)
                records.append({"kernel": name, "dtype": str(dtype), "B": B, "S": S, "d": d,
                                "kernel_us": k * 1e6, "twin_us": t * 1e6, "speedup": t / k})
                print(f"  {name:>15} {str(dtype):>13} B={B} S={S:<3} d={d}: kernel "
                      f"{k * 1e6:8.1f} us, twin {t * 1e6:8.1f} us, speedup {t / k:5.2f}")


# Correctness: executors against the loop executor, levels=1 against serial PyTorch --------

EXECUTORS = {"loop": {"execution": "loop"}, "batched": {"execution": "batched"},
             "streams": {"execution": "streams"},
             "cuda graphs": {"execution": "batched", "cuda_graphs": True}}


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _results(model: nn.Module, work: TrainingWorkload, device: torch.device,
             dtype: torch.dtype) -> list[Tensor]:
    """A no-grad forward's output, then a training step's output and every parameter's
    gradient (in the order of `model.parameters()`), from the model's current weights."""
    model = model.to(device=device, dtype=dtype)
    x, y = work.inputs(torch.Generator().manual_seed(1))
    x = x.to(device=device, dtype=dtype)
    with torch.no_grad():
        evaluated = model(x)
    out = model(x)
    work.loss(out, y.to(device)).backward()
    return [evaluated, out.detach()] + [p.grad for p in model.parameters()]


def _layer_parallel(work: TrainingWorkload, device: torch.device, dtype: torch.dtype
                    ) -> list[Tensor]:
    return _results(build(work)[0], work, device, dtype)


def _serial(work: TrainingWorkload, device: torch.device, dtype: torch.dtype) -> list[Tensor]:
    """Serial PyTorch's results in the layer-parallel model's order: its stacked layer
    gradients are the serial layers' gradients, stacked."""
    model, serial = build(work)
    got = _results(serial, work, device, dtype)
    outputs, grads = got[:2], dict(zip([n for n, _ in serial.named_parameters()], got[2:]))
    steps = range(1, len(serial) - 1)
    ordered = []
    for name, _ in model.named_parameters():
        if name.startswith("layers.params."):
            key = next(n for n in model.layers.names
                       if n.replace(".", "__") == name.removeprefix("layers.params."))
            ordered.append(torch.stack([grads[f"{n}.f.{key}"] for n in steps]))
        else:
            part, rest = name.split(".", 1)
            index = {"opening": 0, "closing": len(serial) - 1}[part]
            ordered.append(grads[f"{index}.{rest}"])
    return outputs + ordered


def _relative_error(actual: Tensor, expected: Tensor) -> float:
    scale = expected.abs().max()
    diff = (actual - expected).abs().max()
    return float(diff / scale) if scale > 0 else float(diff)


def _compare(records: list[dict[str, Any]], failures: list[dict[str, Any]], what: dict,
             got: list[Tensor], twin: list[Tensor], tolerance: float) -> None:
    if len(got) != len(twin):
        raise AssertionError(f"{what}: {len(got)} results against {len(twin)} of the twin")
    names = ["forward output", "training output"] + [f"gradient {k}" for k in
                                                      range(len(got) - 2)]
    errors = [_relative_error(a, b) for a, b in zip(got, twin)]
    worst = max(range(len(errors)), key=errors.__getitem__)
    ok = errors[worst] <= tolerance and all(e == e for e in errors)   # NaN never passes
    rec = {**what, "forward_error": errors[0], "train_output_error": errors[1],
           "gradient_error": max(errors[2:]), "worst": names[worst], "ok": ok}
    records.append(rec)
    print(f"  {what['workload']:>4} {what['method']:>24} {what['dtype']:>13}: forward "
          f"{errors[0]:.1e}, step output {errors[1]:.1e}, gradients {max(errors[2:]):.1e}"
          f"{'' if ok else f'  > {tolerance:.0e} FAILED ({names[worst]})'}", flush=True)
    if not ok:
        failures.append(rec)


def executors(device: torch.device, records: list[dict[str, Any]],
              workloads: tuple[str, ...] = ("w2", "w2b")) -> None:
    failures: list[dict[str, Any]] = []
    for name in workloads:
        work = TRAINING_WORKLOADS[name]()
        for dtype, tolerance in EXECUTOR_TOLERANCE.items():
            what = {"workload": name, "dtype": str(dtype)}
            twin = _layer_parallel(work.with_solver(**EXECUTORS["loop"]), device, dtype)
            pairs: dict[str, tuple[Callable[[], list[Tensor]], Callable[[], list[Tensor]]]] = {
                f"{execution} vs loop": (
                    lambda options=options: _layer_parallel(work.with_solver(**options),
                                                            device, dtype),
                    lambda: twin)
                for execution, options in EXECUTORS.items() if execution != "loop"}
            pairs["levels=1 vs serial pytorch"] = (
                lambda: _layer_parallel(sequential_variant(work), device, dtype),
                lambda: _serial(work, device, dtype))
            for method, (got, expected) in pairs.items():
                try:
                    _compare(records, failures, {**what, "method": method}, got(), expected(),
                             tolerance)
                except Exception:
                    # a variant that cannot run fails alone; the others are still compared
                    failures.append({**what, "method": method, "error": traceback.format_exc()})
                    print(failures[-1]["error"], file=sys.stderr, flush=True)
    if failures:
        raise AssertionError(f"{len(failures)} results differ from their twins' or failed: "
                             f"{failures}")


# Two MPI ranks on one GPU ----------------------------------------------------------------

def two_ranks(device: torch.device, records: list[dict[str, Any]]) -> None:
    from mgrit.app import launch

    script = str(Path(__file__).resolve())
    done = launch.run(2, [script, "--two-ranks-worker", "--device", device.type], timeout=80)
    done.check()
    reported = done.reports[0]
    records += reported["records"]
    for rec in reported["records"]:
        print(f"  {rec['workload']:>4} {rec['dtype']:>13} {rec['messages']:>10}: output "
              f"{rec['output_error']:.1e}, gradients {rec['gradient_error']:.1e}, residual "
              f"histories {rec['residual_error']:.1e}{'' if rec['ok'] else '  FAILED'}",
              flush=True)
    failed = [r for r in reported["records"] if not r["ok"]]
    if failed:
        raise AssertionError(f"2 ranks differ from 1 rank: {failed}")


def _history_error(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest relative difference between two residual histories (inf if their lengths
    differ)."""
    ra, rb = a["residuals"], b["residuals"]
    if len(ra) != len(rb):
        return float("inf")
    return max((abs(x - y) / max(abs(y), 1e-300) for x, y in zip(ra, rb)), default=0.0)


def two_ranks_worker(device: torch.device) -> None:
    """Under `mpiexec -n 2`: every rank runs the workload on its own (1 rank) and across
    both ranks, on the same GPU, and compares what it holds; rank 0 reports."""
    from mpi4py import MPI

    from mgrit.app import launch

    world = MPI.COMM_WORLD
    aware = bool(getattr(MPI, "Query_cuda_support", lambda: False)())
    kinds = ["staged"] + (["cuda-aware"] if aware and device.type == "cuda" else [])
    mine = []
    for messages in kinds:
        os.environ["MGRIT_CUDA_AWARE_MPI"] = "1" if messages == "cuda-aware" else "0"
        for name in ("w2", "w2b"):
            work = TRAINING_WORKLOADS[name]()
            for dtype, tolerance in EXECUTOR_TOLERANCE.items():
                one, _ = build(work)
                both, _ = build(work, comm=world)
                out = {}
                for label, model in (("one", one), ("both", both)):
                    model.to(device=device, dtype=dtype)
                    x, y = work.inputs(torch.Generator().manual_seed(1))
                    output = model(x.to(device=device, dtype=dtype))
                    work.loss(output, y.to(device)).backward()
                    out[label] = output.detach()
                lo, hi = both.layer_range
                pairs = [(p.grad, one.layers.params[k].grad[lo:hi + 1])
                         for k, p in both.layers.params.items()]
                for part in ("opening", "closing"):
                    pairs += [(a.grad, b.grad) for a, b in
                              zip(getattr(both, part).parameters(),
                                  getattr(one, part).parameters())]
                rec = {"workload": name, "dtype": str(dtype), "messages": messages,
                       "rank": world.rank, "layers": [lo, hi],
                       "output_error": _relative_error(out["both"], out["one"]),
                       "gradient_error": max(_relative_error(a, b) for a, b in pairs),
                       "residual_error": max(_history_error(both.stats[k], one.stats[k])
                                             for k in ("forward", "backward")),
                       "device": str(out["both"].device)}
                errors = (rec["output_error"], rec["gradient_error"], rec["residual_error"])
                rec["ok"] = all(e <= tolerance for e in errors)   # NaN never passes
                mine.append(rec)
    gathered = world.gather(mine, root=0)
    if world.rank == 0:
        merged = []
        for k, rec in enumerate(gathered[0]):
            ranks = [g[k] for g in gathered]
            merged.append({**rec, "rank": "max over ranks",
                           "output_error": max(r["output_error"] for r in ranks),
                           "gradient_error": max(r["gradient_error"] for r in ranks),
                           "residual_error": max(r["residual_error"] for r in ranks),
                           "layers": [r["layers"] for r in ranks],
                           "ok": all(r["ok"] for r in ranks)})
        launch.report({"records": merged, "mpi": MPI.Get_library_version().strip(),
                       "cuda_aware": aware})


# Speed -------------------------------------------------------------------------------------

def _event_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of one call, timed with CUDA events on an idle queue, after two
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


def launches(fn: Callable[[], object]) -> dict[str, Any]:
    """Launch calls made by the host and operations run by the GPU in one call of fn."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    host: collections.Counter[str] = collections.Counter()
    device_ops = 0
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            device_ops += 1
        elif event.name in LAUNCH_CALLS:
            host[event.name] += 1
    return {"host_launches": sum(host.values()), "device_ops": device_ops,
            "by_call": dict(host)}


def graphed_step(network: nn.Module, work: TrainingWorkload, x: Tensor, y: Tensor
                 ) -> Callable[[], None]:
    """The serial training step (forward, loss, backward, optimizer step) captured whole as
    one CUDA graph, as a careful user of a launch-bound network would: warmed up on a side
    stream, gradients allocated in the graph's pool, inputs in static buffers."""
    optimizer = work.optimizer(network.parameters())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            work.loss(network(x), y).backward()
            optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        work.loss(network(x), y).backward()
        optimizer.step()
    return graph.replay


def graphed_forward(network: nn.Module, x: Tensor) -> Callable[[], None]:
    """The serial no-grad forward captured as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            network(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        network(x)
    return graph.replay


def _methods(work: TrainingWorkload, device: torch.device, x: Tensor, y: Tensor
             ) -> dict[str, Callable[[], dict[str, Callable[[], None]]]]:
    """method -> a builder of its {"forward": fn, "train_step": fn} (built when timed, so
    that only one method's model is on the device at a time)."""
    def serial() -> dict[str, Callable[[], None]]:
        network = build(work)[1].to(device)
        return {"forward": forward_fn(network, x),
                "train_step": train_step_fn(network, work, x, y)}

    def serial_graphs() -> dict[str, Callable[[], None]]:
        network = build(work)[1].to(device)
        return {"forward": graphed_forward(network, x),
                "train_step": graphed_step(network, work, x, y)}

    def mgrit(variant: TrainingWorkload) -> Callable[[], dict[str, Callable[[], None]]]:
        def make() -> dict[str, Callable[[], None]]:
            model = build(variant)[0].to(device)
            return {"forward": forward_fn(model, x),
                    "train_step": train_step_fn(model, variant, x, y)}
        return make

    methods = {"serial pytorch": serial}
    if device.type == "cuda":
        methods["serial pytorch, cuda graph"] = serial_graphs
    methods["mgrit levels=1"] = mgrit(sequential_variant(work))
    for execution, options in EXECUTORS.items():
        if execution != "loop" and (device.type == "cuda" or not options.get("cuda_graphs")):
            methods[f"mgrit {execution}"] = mgrit(work.with_solver(**options))
    return methods


def speed(device: torch.device, repeats: int, records: list[dict[str, Any]],
          workloads: tuple[str, ...] = ("w2", "w2b", "w1")) -> None:
    failures = []
    for name in workloads:
        work = TRAINING_WORKLOADS[name]()
        print(f"  {name}: {work.description}", flush=True)
        x, y = (t.to(device) for t in work.inputs(torch.Generator().manual_seed(1)))
        plain: dict[str, float] = {}
        for method, make in _methods(work, device, x, y).items():
            try:
                fns = make()
                for metric, fn in fns.items():
                    seconds = (_event_seconds(fn, repeats) if device.type == "cuda" else
                               median_seconds(fn, repeats))
                    plain.setdefault(metric, seconds)
                    rec = {"workload": name, "method": method, "metric": metric,
                           "seconds": seconds, "ratio_to_serial": seconds / plain[metric]}
                    if device.type == "cuda":
                        try:
                            rec.update(launches(fn))
                        except Exception as exc:   # the time is kept without the count
                            rec["launches_error"] = repr(exc)
                    records.append(rec)
                    print(f"  {metric:>10} {method:>26}: {seconds * 1e3:9.3f} ms "
                          f"({rec['ratio_to_serial']:.3f} x serial)"
                          + (f", {rec['host_launches']} launches, {rec['device_ops']} GPU ops"
                             if "host_launches" in rec else ""), flush=True)
            except Exception:
                # one method that cannot run (a capture torch refuses) loses only its row
                failures.append(f"{name} {method}: {traceback.format_exc()}")
                print(failures[-1], file=sys.stderr, flush=True)
            finally:
                torch.cuda.empty_cache() if device.type == "cuda" else None
    if failures:
        raise AssertionError(f"{len(failures)} methods failed:\n" + "\n".join(failures))


# Report --------------------------------------------------------------------------------------

def _environment(device: torch.device) -> dict[str, Any]:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "mgrit": mgrit.__file__, "device": str(device),
           "cpus": os.cpu_count(), "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
    try:
        import mpi4py
        from mpi4py import MPI

        env["mpi4py"] = f"{mpi4py.__version__} ({mpi4py.__file__})"
        env["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
    except Exception as exc:   # reported, not fatal: two_ranks says what it needs
        env["mpi"] = f"not usable: {exc}"
    from mgrit.app.launch import find_mpiexec

    env["mpiexec"] = find_mpiexec()
    return env


def _table(results: dict[str, Any]) -> str:
    lines = [f"environment: {json.dumps(results['environment'])}", "",
             "| section | case | value |", "|---|---|---|"]
    checks = results.get("kernels_vs_twins", [])
    if checks:
        worst = {dt: max(r["max_relative_error"] for r in checks if r["dtype"] == dt)
                 for dt in {r["dtype"] for r in checks}}
        for dt, err in sorted(worst.items()):
            lines.append(f"| kernels vs twins | worst {dt} | {err:.2e} |")
    for rec in results.get("executors", []):
        lines.append(f"| executors {rec['workload']} {rec['dtype']} | {rec['method']} | "
                     f"forward {rec['forward_error']:.1e}, step output "
                     f"{rec['train_output_error']:.1e}, gradients {rec['gradient_error']:.1e}"
                     f"{'' if rec['ok'] else ' FAILED'} |")
    for rec in results.get("two_ranks", []):
        lines.append(f"| 2 ranks vs 1, {rec['workload']} {rec['dtype']} | {rec['messages']} "
                     f"messages | output {rec['output_error']:.1e}, gradients "
                     f"{rec['gradient_error']:.1e}, residuals {rec['residual_error']:.1e}"
                     f"{'' if rec['ok'] else ' FAILED'} |")
    for rec in results.get("speed", []):
        counts = (f", {rec['host_launches']} launches, {rec['device_ops']} GPU ops"
                  if "host_launches" in rec else "")
        lines.append(f"| {rec['workload']} {rec['metric']} | {rec['method']} | "
                     f"{rec['seconds'] * 1e3:.3f} ms ({rec['ratio_to_serial']:.3f}x serial)"
                     f"{counts} |")
    for rec in results.get("kernel_timing", []):
        lines.append(f"| kernel timing | {rec['kernel']} {rec['dtype']} B={rec['B']} "
                     f"S={rec['S']} d={rec['d']} | kernel {rec['kernel_us']:.1f} us, twin "
                     f"{rec['twin_us']:.1f} us ({rec['speedup']:.2f}x) |")
    for section, error in results["failures"].items():
        lines.append(f"| {section} | FAILED | {error.strip().splitlines()[-1]} |")
    return "\n".join(lines) + "\n"


def run_section(section: str, device: torch.device, repeats: int) -> dict[str, Any]:
    """Records of one section, and its traceback if it failed (the records up to there)."""
    sections: dict[str, Callable[[list[dict[str, Any]]], None]] = {
        "kernels_vs_twins": lambda records: kernels_vs_twins(device, records),
        "kernel_timing": lambda records: kernel_timing(device, repeats, records),
        "executors": lambda records: executors(device, records),
        "two_ranks": lambda records: two_ranks(device, records),
        "speed": lambda records: speed(device, repeats, records)}
    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    try:
        sections[section](records)
        failure = None
    except Exception:
        failure = traceback.format_exc()
        print(failure, file=sys.stderr, flush=True)
    return {"records": records, "failure": failure, "seconds": time.perf_counter() - start}


def _run_isolated(section: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One section in a process of its own, under its time limit: a kernel fault that
    poisons the CUDA context, or a hang, takes nothing else with it."""
    part_file = work / f"section-{section}.json"
    limit = SECTIONS[section][0] * args.time_scale
    command = [sys.executable, __file__, "--section", section, "--work", str(work),
               "--repeats", str(args.repeats), "--device", args.device]
    try:
        proc = subprocess.run(command, timeout=limit)
        status = f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = f"no end within its limit of {limit:.0f} s (killed)"
    if part_file.exists():
        return json.loads(part_file.read_text())
    return {"records": [], "seconds": limit,
            "failure": f"the section's process wrote no results: {status}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a dry run of the script without a GPU")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="the sections to run, in this order (default: all)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiplies every section's time limit")
    parser.add_argument("--section", choices=list(SECTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--two-ranks-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    chosen = [s for s in args.sections.split(",") if s]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"error: torch {torch.__version__} sees no CUDA device (CUDA build: "
              f"{torch.version.cuda}); run this on a machine with an NVIDIA GPU and a CUDA "
              "build of torch, or pass --device cpu for a dry run", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # the twins in true float32
    torch.backends.cudnn.allow_tf32 = False
    if args.two_ranks_worker:
        two_ranks_worker(device)
        return 0
    if args.section:
        part = run_section(args.section, device, args.repeats)
        (args.work / f"section-{args.section}.json").write_text(
            json.dumps(part, indent=1, default=str))
        return 1 if part["failure"] else 0

    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"environment": _environment(device), "failures": {},
                               "seconds": {}}
    print("environment: " + json.dumps(results["environment"]), flush=True)
    with tempfile.TemporaryDirectory(prefix="mgrit-gpu-check-") as work:
        for section in chosen:
            if SECTIONS[section][1] and device.type != "cuda":
                continue
            print(f"{section}:", flush=True)
            part = _run_isolated(section, args, Path(work))
            results[section], results["seconds"][section] = part["records"], part["seconds"]
            if part["failure"]:
                results["failures"][section] = part["failure"]
            print(f"{section}: {'FAILED' if part['failure'] else 'passed'} "
                  f"({part['seconds']:.0f} s)", flush=True)
            (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    table = _table(results)
    (args.out / "gpu_check.md").write_text(table)
    print(table)
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
