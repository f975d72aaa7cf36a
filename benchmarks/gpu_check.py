"""GPU check of the CUDA kernels and of layer-parallel training (run by gpu_check.sh).

    python benchmarks/gpu_check.py [--out DIR] [--repeats N] [--device cuda|cpu]

Sections, each run in its own process and written to DIR/gpu_check.json as soon as it ends:
  kernels_vs_twins  max relative error max|kernel - twin| / max|twin| of each kernel
                    (asserted: float64 <= 1e-12, float32 <= 1e-5)
  kernel_timing     kernels against their twins, B = 256 intervals, d = 32, S = 1 and 32
  executors         the batched executor (also with CUDA graphs of its sweeps) and the
                    stream executor against their twin, the loop executor: one W2 and W2b
                    training step (output and every gradient, asserted: float64 <= 1e-12,
                    float32 <= 1e-4 relative), then each one's forward pass and training
                    step, medians of --repeats
  model_timing      serial PyTorch against layer-parallel MGRIT (one rank) on W2 and W2b:
                    forward pass and training step, medians of --repeats
A failing section is recorded with its error and the others still run; the exit status is
1 if any failed, 2 without a CUDA device. `--device cpu` is a dry run of the script on a
machine without a GPU: the kernel sections are skipped, executors and model_timing run on
the CPU (where the stream executor is the loop).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

import mgrit
from mgrit.kernels import cuda as kernels

from benchmarks.timing import median_seconds
from benchmarks.training import build, forward_fn, train_step_fn
from benchmarks.workloads import TRAINING_WORKLOADS, TrainingWorkload

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
# (B, S, d): the timing shapes, partial sample tiles, widths off the warp size, the
# one-sample path (a tile too wide for shared memory)
CHECK_SHAPES = [(256, 1, 32), (256, 32, 32), (5, 13, 40), (3, 9, 130), (2, 3, 800)]
TIMING_SHAPES = [(256, 1, 32), (256, 32, 32)]
KERNEL_CALLS = 100  # back-to-back calls per timed kernel repeat
SECTIONS = ("kernels_vs_twins", "kernel_timing", "executors", "model_timing")
# the executors' results against the loop executor's (relative to its largest entry): a
# float32 training step goes through 1024 layers and three MGRIT cycles
EXECUTOR_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-4}


def _problem(B: int, S: int, d: int, dtype: torch.dtype, device: torch.device
             ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(B * 10007 + S * 101 + d)
    tensors = {"u": torch.randn(B, S, d, generator=gen, dtype=dtype),
               "W": torch.randn(B, d, d, generator=gen, dtype=dtype) / d ** 0.5,
               "b": torch.randn(B, d, generator=gen, dtype=dtype),
               "g": torch.randn(B, S, d, generator=gen, dtype=dtype)}
    return {k: v.to(device) for k, v in tensors.items()}


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


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


# executor variants: the solver options each sets, forward and backward
EXECUTORS = {"loop": {"execution": "loop"}, "batched": {"execution": "batched"},
             "streams": {"execution": "streams"},
             "cuda graphs": {"execution": "batched", "cuda_graphs": True}}


def _one_step(work: TrainingWorkload, device: torch.device, dtype: torch.dtype
              ) -> list[torch.Tensor]:
    """A training step's output and every parameter's gradient, from the same weights."""
    model, _ = build(work)
    model = model.to(device=device, dtype=dtype)
    x, y = work.inputs(torch.Generator().manual_seed(1))
    out = model(x.to(device=device, dtype=dtype))
    work.loss(out, y.to(device)).backward()
    return [out.detach()] + [p.grad for p in model.parameters()]


def executors(device: torch.device, repeats: int, records: list[dict[str, Any]],
              workloads: tuple[str, ...] = ("w2", "w2b")) -> None:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    failures = []
    for name in workloads:
        work = TRAINING_WORKLOADS[name]()
        print(f"  {work.description}")
        for dtype, tolerance in EXECUTOR_TOLERANCE.items():
            twin = _one_step(work.with_solver(**EXECUTORS["loop"]), device, dtype)
            for execution in [e for e in EXECUTORS if e != "loop"]:
                got = _one_step(work.with_solver(**EXECUTORS[execution]), device, dtype)
                err = max(_relative_error(a, b) for a, b in zip(got, twin))
                ok = err <= tolerance
                records.append({"workload": name, "execution": execution, "dtype": str(dtype),
                                "max_relative_error": err, "ok": ok})
                print(f"  {execution:>11} vs loop {str(dtype):>13}: output and gradients, max "
                      f"relative error {err:.2e}{'' if ok else f'  > {tolerance:.0e} FAILED'}")
                if not ok:
                    failures.append(records[-1])
        x, y = (t.to(device) for t in work.inputs(torch.Generator().manual_seed(1)))
        for execution in EXECUTORS:
            model, _ = build(work.with_solver(**EXECUTORS[execution]))
            model = model.to(device)
            for metric, fn in (("forward", forward_fn(model, x)),
                               ("train_step", train_step_fn(model, work, x, y))):
                seconds = median_seconds(fn, repeats, sync)
                records.append({"workload": name, "execution": execution, "metric": metric,
                                "seconds": seconds})
                print(f"  {metric:>10} {execution:>11}: {seconds * 1e3:9.2f} ms")
    if failures:
        raise AssertionError(f"{len(failures)} executor results differ from the loop "
                             f"executor's: {failures}")


def model_timing(device: torch.device, repeats: int, records: list[dict[str, Any]]) -> None:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for name in ("w2", "w2b"):
        work = TRAINING_WORKLOADS[name]()
        print(f"  {work.description}")
        model, serial = build(work)
        model, serial = model.to(device), serial.to(device)
        x, y = (t.to(device) for t in work.inputs(torch.Generator().manual_seed(1)))
        with torch.no_grad():  # before either is trained
            model.eval()
            error = _relative_error(model(x), serial(x))
            model.train()
        records.append({"workload": name, "method": "layer-parallel mgrit",
                        "metric": "eval_output_vs_serial", "max_relative_error": error})
        print(f"  eval output vs serial: max relative error {error:.2e}")
        serial_seconds = {}
        for method, net in (("serial pytorch", serial), ("layer-parallel mgrit", model)):
            for metric, fn in (("forward", forward_fn(net, x)),
                               ("train_step", train_step_fn(net, work, x, y))):
                seconds = median_seconds(fn, repeats, sync)
                serial_seconds.setdefault(metric, seconds)
                ratio = seconds / serial_seconds[metric]
                records.append({"workload": name, "method": method, "metric": metric,
                                "seconds": seconds, "ratio_to_serial": ratio})
                print(f"  {metric:>10} {method:>22}: {seconds * 1e3:9.2f} ms "
                      f"({ratio:.2f} x serial)")
        records.append({"workload": name, "method": "layer-parallel mgrit",
                        "metric": "solver_stats", "stats": model.stats})


def _environment(device: torch.device) -> dict[str, Any]:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "mgrit": mgrit.__file__, "device": str(device),
           "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
    return env


def _table(results: dict[str, Any]) -> str:
    lines = ["| section | case | value |", "|---|---|---|"]
    for rec in results.get("kernel_timing", []):
        lines.append(f"| kernel timing | {rec['kernel']} {rec['dtype']} B={rec['B']} "
                     f"S={rec['S']} d={rec['d']} | kernel {rec['kernel_us']:.1f} us, twin "
                     f"{rec['twin_us']:.1f} us ({rec['speedup']:.2f}x) |")
    checks = results.get("kernels_vs_twins", [])
    if checks:
        worst = {dt: max(r["max_relative_error"] for r in checks if r["dtype"] == dt)
                 for dt in {r["dtype"] for r in checks}}
        for dt, err in sorted(worst.items()):
            lines.append(f"| kernels vs twins | worst {dt} | {err:.2e} |")
    for rec in results.get("executors", []):
        if "seconds" in rec:
            lines.append(f"| executors {rec['workload']} {rec['metric']} | {rec['execution']} "
                         f"| {rec['seconds'] * 1e3:.2f} ms |")
        else:
            lines.append(f"| executors {rec['workload']} {rec['dtype']} | {rec['execution']} "
                         f"vs loop | {rec['max_relative_error']:.2e} |")
    for rec in results.get("model_timing", []):
        if "seconds" in rec:
            lines.append(f"| {rec['workload']} {rec['metric']} | {rec['method']} | "
                         f"{rec['seconds'] * 1e3:.2f} ms ({rec['ratio_to_serial']:.2f}x serial) |")
        elif "max_relative_error" in rec:
            lines.append(f"| {rec['workload']} eval output | {rec['method']} vs serial | "
                         f"{rec['max_relative_error']:.2e} |")
    for section, error in results["failures"].items():
        lines.append(f"| {section} | FAILED | {error.splitlines()[-1]} |")
    return "\n".join(lines) + "\n"


def run_section(section: str, device: torch.device, repeats: int) -> dict[str, Any]:
    """Records of one section, and its traceback if it failed (the records up to there)."""
    sections: dict[str, Callable[[list[dict[str, Any]]], None]] = {
        "kernels_vs_twins": lambda records: kernels_vs_twins(device, records),
        "kernel_timing": lambda records: kernel_timing(device, repeats, records),
        "executors": lambda records: executors(device, repeats, records),
        "model_timing": lambda records: model_timing(device, repeats, records)}
    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    try:
        sections[section](records)
        failure = None
    except Exception:
        failure = traceback.format_exc()
        print(failure, file=sys.stderr)
    return {"records": records, "failure": failure, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a dry run of the script without a GPU")
    parser.add_argument("--section", choices=SECTIONS,
                        help="run only this section, writing OUT/section-NAME.json")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"error: torch {torch.__version__} sees no CUDA device (CUDA build: "
              f"{torch.version.cuda}); run this on a machine with an NVIDIA GPU and a CUDA "
              "build of torch, or pass --device cpu for a dry run", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # the twins in true float32
    args.out.mkdir(parents=True, exist_ok=True)
    if args.section:
        part = run_section(args.section, device, args.repeats)
        (args.out / f"section-{args.section}.json").write_text(
            json.dumps(part, indent=1, default=str))
        return 1 if part["failure"] else 0

    # each section in its own process: a kernel fault that poisons the CUDA context (an
    # illegal address) cannot take the other sections' measurements with it
    results: dict[str, Any] = {"environment": _environment(device), "failures": {},
                               "seconds": {}}
    for section in SECTIONS if device.type == "cuda" else ("executors", "model_timing"):
        print(f"{section}:", flush=True)
        part_file = args.out / f"section-{section}.json"
        part_file.unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, __file__, "--section", section, "--out",
                               str(args.out), "--repeats", str(args.repeats), "--device",
                               args.device])
        if part_file.exists():
            part = json.loads(part_file.read_text())
            results[section], results["seconds"][section] = part["records"], part["seconds"]
            if part["failure"]:
                results["failures"][section] = part["failure"]
        else:
            results["failures"][section] = (f"the section's process ended with exit status "
                                            f"{proc.returncode} and wrote no results")
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    table = _table(results)
    (args.out / "gpu_check.md").write_text(table)
    print(table)
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
