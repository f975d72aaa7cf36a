"""Trusting inexact gradients: serial training, fixed MGRIT cycles, exact stepping and the
controller (`mgrit.nn.Controller`) side by side, and what warm starts do to the gradients.

    python -m benchmarks.controller --json FILE [--cases deep,w3] [--ranks P] [--no-threshold]
                                    [--overhead w1] [--warm w1,w2,w3,deep,w4]

Training comparison, per case, the same seed, initial weights and data order for every
method, all in this process on one thread:

- serial: the plain network with autograd;
- fixed: layer-parallel with the case's MGRIT settings (2 forward, 1 backward cycle);
- exact: layer-parallel with exact stepping (levels=1, one sequential sweep each way);
- controller: the fixed settings with the default controller deciding from step 0;
- chosen: the settings `mgrit.nn.choose_settings` picks at the controller's default
  threshold (cheapest by the calibrated cost model among those whose gradient error,
  measured on the first training batch, is within it), kept for the whole run; the
  choice's time counts as training time.

Cases: "deep", a 1024-layer dense tanh ResNet on the digits at T = 8 with 5 levels, where
2/1 cycles give gradients with relative errors of 1-2 (they train it to a clearly worse
network); "w3", W3 itself (32 layers, 3 levels); and "w2-digits", W2's network and
hierarchy (1024 layers, T = 1, 4 levels) on the digits. Each run reports its final test loss
and accuracy and its training time (process CPU time, which another job on the machine
disturbs less than wall time, and wall time); the controller's time includes its probes.

Threshold study: the deep network at T = 4 trained with fixed settings of growing accuracy
(2/1, 2/2 and 3/2 cycles at 5 levels, exact stepping), its gradient error probed every 20
steps: which errors still train as well as exact gradients (the controller's default
threshold rests on it).

Overhead (`--overhead`): a workload's steps with its fixed settings and with the controller,
on the workload's own batches; the CPU time of each.

Warm starts (`--warm`): the same workload trained twice for a few steps at the same cycle
counts, from a zero guess and from the previous step's states (`initial_guess="warm"`),
with probes of the gradient error against exact stepping (which do not disturb training);
the mean last residual of each solve and the median gradient error of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from mgrit.app.data import batches, digits
from mgrit.app.loop import evaluate, train_step
from mgrit.core.config import Config
from mgrit.nn import Controller, choose_settings, probe
from mgrit.nn.controller import THRESHOLD
from mgrit.nn.blocks import ResNetSpec, dense_step
from mgrit.nn.defaults import training_config

from .training import hierarchy_label, hierarchy_of
from .workloads import W3_SETTINGS, TrainingWorkload, w1_workload, w2_workload, w4_workload

# The harmful case: deep, a large T (h = T/N = 1/128, coarse steps of up to 2 on the fifth
# level) and 5 levels; the optimizer and data are W3's.
CASES: dict[str, dict[str, Any]] = {
    "deep": dict(width=32, num_steps=1024, t_final=8.0, levels=5, coarsening=4, epochs=8,
                 batch_size=32, lr=0.05, seed=0),
    "w3": dict(W3_SETTINGS, t_final=1.0, levels=3, coarsening=4),
    # W2's network (1024 dense tanh layers, width 32, T = 1) and hierarchy on the digits
    "w2-digits": dict(width=32, num_steps=1024, t_final=1.0, levels=4, coarsening=4, epochs=8,
                      batch_size=32, lr=0.05, seed=0),
}
METHODS = ("serial", "fixed", "exact", "controller", "chosen")
# the threshold study: the deep network at T = 4, trained with fixed settings of growing
# accuracy (forward cycles, backward cycles, levels; levels 1 is exact stepping)
THRESHOLD_CASE = dict(CASES["deep"], t_final=4.0)
THRESHOLD_SETTINGS = ((2, 1, 5), (2, 2, 5), (3, 2, 5), (1, 1, 1))
EXACT = Config(levels=1, max_iter=1, tol=0.0)


def network(case: dict[str, Any]) -> ResNetSpec:
    """W3's network (`digits_dense`) with the case's width, depth and T."""
    width = case["width"]
    opening = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.Tanh())
    return ResNetSpec(opening, dense_step(width), nn.Linear(width, 10), case["num_steps"],
                      case["t_final"])


def train(name: str, method: str, epochs: int | None = None, ranks: int = 1
          ) -> dict[str, Any]:
    """Train case `name` with `method`; the final test loss and accuracy, the training
    time (evaluations left out) and, for the controller, what it measured and did."""
    case = CASES[name]
    epochs = epochs or case["epochs"]
    split = digits()
    torch.manual_seed(case["seed"])
    spec = network(case)
    controller = None
    if method == "serial":
        model: nn.Module = spec.serial()
    elif method == "exact":
        model = spec.layer_parallel(forward=EXACT, backward=EXACT)
    else:
        model = spec.layer_parallel(
            forward=training_config("forward", case["levels"], case["coarsening"]),
            backward=training_config("backward", case["levels"], case["coarsening"]))
        if method == "controller":
            controller = Controller(model, ranks=ranks)
    optimizer = torch.optim.SGD(model.parameters(), lr=case["lr"], momentum=0.9)
    generator = torch.Generator().manual_seed(case["seed"])
    loss_fn = nn.functional.cross_entropy
    cpu = wall = 0.0
    curve = []
    chosen = None
    if method == "chosen":
        cpu0, wall0 = time.process_time(), time.perf_counter()
        x0, y0 = next(iter(batches(split.x_train, split.y_train, case["batch_size"],
                                   torch.Generator().manual_seed(case["seed"]))))
        # MGRIT's own settings: a pass stepped exactly is not what this study measures
        chosen = choose_settings(model, lambda: loss_fn(model(x0), y0), ranks=ranks,
                                 threshold=THRESHOLD, exact_passes=False)
        model.set_solvers(*chosen)
        cpu += time.process_time() - cpu0
        wall += time.perf_counter() - wall0
    for _ in range(epochs):
        model.train()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for xb, yb in batches(split.x_train, split.y_train, case["batch_size"], generator):
            train_step(model, optimizer, loss_fn, xb, yb, control=controller)
        cpu += time.process_time() - cpu0
        wall += time.perf_counter() - wall0
        test_loss, test_accuracy = evaluate(model, split.x_test, split.y_test, loss_fn)
        curve.append(test_loss)
        if controller is not None:
            controller.validation(test_loss)
    record = {"case": name, "method": method, "epochs": epochs, "test_loss": test_loss,
              "test_accuracy": test_accuracy, "cpu_seconds": cpu, "wall_seconds": wall,
              "test_losses": curve}
    if controller is not None:
        record.update(controller_record(controller))
    if chosen is not None:
        record["chosen"] = hierarchy_label(hierarchy_of(*chosen))
    return record


def controller_record(controller: Controller) -> dict[str, Any]:
    """What the controller measured and did in a run: its probes, their seconds, the
    median and first gradient error, the setting it ended with and its changes."""
    errors = sorted(p["error"] for p in controller.probes)
    return {"probes": len(controller.probes),
            "probe_seconds": sum(p["seconds"] for p in controller.probes),
            "median_error": errors[len(errors) // 2],
            "first_error": controller.probes[0]["error"],
            "final_setting": controller.setting.label, "decisions": controller.decisions}


def compare(name: str, epochs: int | None = None, ranks: int = 1) -> dict[str, Any]:
    """Every method on case `name`, with the ratios the controller is judged by; the
    controller and the chosen settings priced for `ranks` ranks."""
    runs = {}
    for method in METHODS:
        runs[method] = train(name, method, epochs, ranks)
        print(f"  {name} {method}: test loss {runs[method]['test_loss']:.4f}, "
              f"{runs[method]['cpu_seconds']:.1f} s", file=sys.stderr, flush=True)
    serial, fixed, exact = runs["serial"], runs["fixed"], runs["exact"]
    for run in runs.values():
        run["loss_vs_serial"] = run["test_loss"] / serial["test_loss"] - 1
        run["accuracy_vs_serial_pp"] = (run["test_accuracy"] - serial["test_accuracy"]) * 100
        run["cpu_vs_fixed"] = run["cpu_seconds"] / fixed["cpu_seconds"]
        run["cpu_vs_exact"] = run["cpu_seconds"] / exact["cpu_seconds"]
    return runs


def table(name: str, runs: dict[str, Any]) -> str:
    case = CASES[name]
    lines = [f"{name}: dense tanh ResNet, width {case['width']}, N = {case['num_steps']}, T = "
             f"{case['t_final']}, MGRIT {case['levels']} levels, m = {case['coarsening']}, "
             f"{runs['serial']['epochs']} epochs, batch {case['batch_size']}, SGD "
             f"{case['lr']}/0.9, seed {case['seed']}", "",
             "| method | test loss | vs serial | test accuracy | vs serial (pp) | CPU s | "
             "vs fixed | vs exact |", "|---|---|---|---|---|---|---|---|"]
    for method, r in runs.items():
        lines.append(f"| {method} | {r['test_loss']:.4f} | {r['loss_vs_serial'] * 100:+.1f}% | "
                     f"{r['test_accuracy'] * 100:.2f}% | {r['accuracy_vs_serial_pp']:+.2f} | "
                     f"{r['cpu_seconds']:.1f} | {r['cpu_vs_fixed']:.2f} | "
                     f"{r['cpu_vs_exact']:.2f} |")
    if "chosen" in runs:
        lines += ["", f"chosen: {runs['chosen']['chosen']}"]
    c = runs["controller"]
    moves = ", ".join(f"step {d['step']}: {d['from']} -> {d['to']}" for d in c["decisions"])
    lines += ["", f"controller: {c['probes']} probes ({c['probe_seconds']:.1f} s of its "
              f"{c['cpu_seconds']:.1f} s), gradient error at step 0 {c['first_error']:.3f}, "
              f"median {c['median_error']:.3f}; setting at the end {c['final_setting']}"
              + (f"; changes: {moves}" if moves else "; no change")]
    return "\n".join(lines)


# what error is too much -----------------------------------------------------------------------

def threshold_study(every: int = 20, epochs: int | None = None) -> list[dict[str, Any]]:
    """THRESHOLD_CASE trained with each of THRESHOLD_SETTINGS (same seed and batches),
    the gradient error probed every `every` steps (probes leave training as it is): the
    median and largest error of each setting and its final test loss and accuracy."""
    case = THRESHOLD_CASE
    split = digits()
    loss_fn = nn.functional.cross_entropy
    out = []
    for forward, backward, levels in THRESHOLD_SETTINGS:
        torch.manual_seed(case["seed"])
        configs = [replace(training_config(kind, max(levels, 2), case["coarsening"]),
                           levels=levels, max_iter=cycles)
                   for kind, cycles in (("forward", forward), ("backward", backward))]
        model = network(case).layer_parallel(forward=configs[0], backward=configs[1])
        optimizer = torch.optim.SGD(model.parameters(), lr=case["lr"], momentum=0.9)
        generator = torch.Generator().manual_seed(case["seed"])
        errors, step = [], 0
        for _ in range(epochs or case["epochs"]):
            model.train()
            for xb, yb in batches(split.x_train, split.y_train, case["batch_size"], generator):
                optimizer.zero_grad()
                loss_fn(model(xb), yb).backward()
                if levels > 1 and step % every == 0:
                    errors.append(probe(model, lambda: loss_fn(model(xb), yb)).error)
                optimizer.step()
                step += 1
        test_loss, test_accuracy = evaluate(model, split.x_test, split.y_test, loss_fn)
        out.append({"setting": "exact" if levels == 1 else f"{forward}/{backward} L{levels}",
                    "median_error": statistics.median(errors) if errors else 0.0,
                    "largest_error": max(errors, default=0.0), "test_loss": test_loss,
                    "test_accuracy": test_accuracy})
        print(f"  threshold study {out[-1]['setting']}: test loss {test_loss:.4f}",
              file=sys.stderr, flush=True)
    exact = out[-1]["test_loss"]
    for row in out:
        row["loss_vs_exact"] = row["test_loss"] / exact - 1
    return out


def threshold_table(rows: list[dict[str, Any]], epochs: int | None = None) -> str:
    case = THRESHOLD_CASE
    lines = [f"threshold: N = {case['num_steps']}, T = {case['t_final']}, "
             f"{epochs or case['epochs']} epochs, otherwise as deep", "",
             "| setting | gradient error (median) | largest | test loss | vs exact | "
             "test accuracy |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['median_error']:.3f} | {r['largest_error']:.3f} | "
                     f"{r['test_loss']:.4f} | {r['loss_vs_exact'] * 100:+.1f}% | "
                     f"{r['test_accuracy'] * 100:.2f}% |")
    return "\n".join(lines)


# the controller's overhead on a workload ----------------------------------------------------

def overhead(work: TrainingWorkload, steps: int, seed: int = 0) -> dict[str, Any]:
    """`steps` training steps of `work` with its fixed settings and with the controller
    (same seed and batches): CPU seconds of each and their ratio, the controller's probes
    and the setting it ends with."""
    out: dict[str, Any] = {"steps": steps}
    for method in ("fixed", "controller"):
        torch.manual_seed(seed)
        model = work.network().layer_parallel(forward=work.forward, backward=work.backward)
        controller = Controller(model) if method == "controller" else None
        optimizer = work.optimizer(model.parameters())
        generator = torch.Generator().manual_seed(seed)
        inputs = [work.inputs(generator) for _ in range(steps)]
        model.train()
        cpu = time.process_time()
        for x, y in inputs:
            train_step(model, optimizer, work.loss, x, y, control=controller)
        out[method] = {"cpu_seconds": time.process_time() - cpu}
        if controller is not None:
            out[method].update(probes=len(controller.probes),
                               probe_seconds=sum(p["seconds"] for p in controller.probes),
                               final_setting=controller.setting.label,
                               median_error=statistics.median(p["error"]
                                                              for p in controller.probes))
    out["cpu_vs_fixed"] = out["controller"]["cpu_seconds"] / out["fixed"]["cpu_seconds"]
    return out


# warm starts ---------------------------------------------------------------------------------

def case_workload(name: str) -> TrainingWorkload:
    """A training case as a workload: random batches of the digits' training images."""
    split = digits()
    case = CASES[name]

    def inputs(g: torch.Generator):
        pick = torch.randperm(len(split.x_train), generator=g)[:case["batch_size"]]
        return split.x_train[pick], split.y_train[pick]

    return TrainingWorkload(
        name, name, lambda: network(case),
        training_config("forward", case["levels"], case["coarsening"]),
        training_config("backward", case["levels"], case["coarsening"]), inputs,
        nn.functional.cross_entropy,
        lambda p: torch.optim.SGD(p, lr=case["lr"], momentum=0.9))


OVERHEAD = {"w1": (w1_workload, 80), "w2": (w2_workload, 200)}
WARM_STUDIES = {"w1": (w1_workload, 40, 5), "w2": (w2_workload, 40, 5),
                "w3": (lambda: case_workload("w3"), 120, 10),
                "deep": (lambda: case_workload("deep"), 40, 5),
                "w4": (w4_workload, 20, 4)}


def warm_study(work: TrainingWorkload, steps: int, every: int, seed: int = 0
               ) -> dict[str, Any]:
    """`steps` training steps from a zero guess and from warm starts (the same cycles,
    seed and batches): mean last residual of each solve and the gradient error against
    exact stepping at every `every`-th step."""
    out = {}
    for guess in ("zero", "warm"):
        torch.manual_seed(seed)
        model = work.network().layer_parallel(
            forward=replace(work.forward, initial_guess=guess),
            backward=replace(work.backward, initial_guess=guess))
        optimizer = work.optimizer(model.parameters())
        generator = torch.Generator().manual_seed(seed)
        forward, backward, errors = [], [], []
        for k in range(steps):
            x, y = work.inputs(generator)
            model.train()
            optimizer.zero_grad()
            work.loss(model(x), y).backward()
            if k % every == every - 1:
                errors.append(probe(model, lambda: work.loss(model(x), y)).error)
            if k > 0:       # the first step starts cold either way
                forward.append(model.stats["forward"]["residuals"][-1])
                backward.append(model.stats["backward"]["residuals"][-1])
            optimizer.step()
        out[guess] = {"forward_residual": statistics.fmean(forward),
                      "backward_residual": statistics.fmean(backward),
                      "median_error": statistics.median(errors), "errors": errors}
    return out


def warm_table(results: dict[str, Any]) -> str:
    lines = ["| workload | guess | forward residual | backward residual | gradient error "
             "(median) |", "|---|---|---|---|---|"]
    for name, study in results.items():
        for guess, r in study.items():
            lines.append(f"| {name} | {guess} | {r['forward_residual']:.2e} | "
                         f"{r['backward_residual']:.2e} | {r['median_error']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.controller",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write every number here")
    parser.add_argument("--cases", default="deep,w3", help="training comparisons to run "
                        f"({', '.join(CASES)}; empty: none)")
    parser.add_argument("--epochs", type=int, help="epochs of every case (default: its own)")
    parser.add_argument("--ranks", type=int, default=1, help="price the controller's and the "
                        "chosen settings for this many layer-parallel ranks (the training "
                        "runs in one process either way: its arithmetic is the same on any "
                        "number of ranks)")
    parser.add_argument("--no-threshold", action="store_true", help="leave out the "
                        "threshold study (fixed settings of growing accuracy at T = 4)")
    parser.add_argument("--overhead", default="w1", help="workloads whose steps are timed "
                        "with fixed settings and with the controller (w1, w2; empty: none)")
    parser.add_argument("--warm", default="w1,w2,w3,deep,w4", help="warm-start studies to run "
                        f"({', '.join(WARM_STUDIES)}; empty: none)")
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error(f"--ranks must be at least 1, got {args.ranks}")
    torch.set_num_threads(1)
    result: dict[str, Any] = {"cases": {}, "overhead": {}, "warm": {}}
    for name in filter(None, args.cases.split(",")):
        if name not in CASES:
            parser.error(f"unknown case {name!r}; choose from {', '.join(CASES)}")
        runs = compare(name, args.epochs, args.ranks)
        result["cases"][name] = {"settings": CASES[name], "ranks": args.ranks, "runs": runs}
        print(table(name, runs) + "\n", flush=True)
    if not args.no_threshold:
        result["threshold"] = threshold_study(epochs=args.epochs)
        print(threshold_table(result["threshold"], args.epochs) + "\n", flush=True)
    for name in filter(None, args.overhead.split(",")):
        if name not in OVERHEAD:
            parser.error(f"unknown workload {name!r}; choose from {', '.join(OVERHEAD)}")
        make, steps = OVERHEAD[name]
        o = result["overhead"][name] = overhead(make(), steps)
        c = o["controller"]
        print(f"{name}, {steps} steps: fixed {o['fixed']['cpu_seconds']:.1f} s, controller "
              f"{c['cpu_seconds']:.1f} s ({o['cpu_vs_fixed']:.2f} x; {c['probes']} probes, "
              f"{c['probe_seconds']:.1f} s; median gradient error {c['median_error']:.4f}; "
              f"setting at the end {c['final_setting']})\n", flush=True)
    for name in filter(None, args.warm.split(",")):
        if name not in WARM_STUDIES:
            parser.error(f"unknown warm-start study {name!r}; choose from "
                         f"{', '.join(WARM_STUDIES)}")
        make, steps, every = WARM_STUDIES[name]
        result["warm"][name] = warm_study(make(), steps, every)
        print(f"  warm starts {name} done", file=sys.stderr, flush=True)
    if result["warm"]:
        print(warm_table(result["warm"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
