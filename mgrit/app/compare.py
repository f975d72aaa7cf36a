"""`mgrit compare`: serial and layer-parallel training side by side, and convergence studies
of the solver alone; figures (PNG), a Markdown table and JSON."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from . import launch, plot
from ..core.config import Config
from ..core.cycle import DivergenceError, solve
from ..core.grid import level0_blocks
from ..nn.checks import level_grids, partition
from ..nn.defaults import training_options
from ..problems import Dahlquist, Heat1D, ModuleResNet
from .outputs import refuse_used
from .settings import Settings, SettingsError, plain_options
from .train import Run, refuse_layout


def _with_output(settings: Settings, folder: Path, serial: bool, label: str) -> Settings:
    s = copy.deepcopy(settings)
    s.output.dir = str(folder)
    s.output.label = label
    s.training.serial = serial
    return s


def refuse_layer_parallel(settings: Settings, ranks: int) -> None:
    """What would stop the layer-parallel run on `ranks` ranks, said before the serial run
    trains: its layout, its solvers' levels against the layers, the layers' partition."""
    lp = _with_output(settings, Path(settings.output.dir), serial=False, label="")
    refuse_layout(lp, ranks, resume=False)
    steps = lp.network.steps
    try:
        grids = {kind: level_grids(kind, lp.solver(kind), steps)
                 for kind in ("forward", "backward")}
        partition(level0_blocks(grids["forward"], ranks // lp.training.data_parallel), steps)
    except ValueError as err:
        raise SettingsError(str(err)) from None


def train_both(settings: Settings, out: Path, ranks: int) -> dict[str, Path]:
    """Serial training in this process; layer-parallel training here (1 rank) or under
    `mpiexec -n ranks`. Same seed, same data order. Both output folders and the
    layer-parallel settings are checked before either run starts, so that a used folder
    or a network the ranks cannot share is refused before any training."""
    folders = {"serial": out / "serial", "layer-parallel": out / "layer-parallel"}
    refuse_layer_parallel(settings, ranks)
    for folder in folders.values():
        refuse_used(folder, settings.output.overwrite)
    Run(_with_output(settings, folders["serial"], serial=True, label="serial")).run()
    if torch.cuda.is_initialized():
        # the layer-parallel ranks share the GPU next: this process keeps its context, not
        # the serial run's cached memory
        torch.cuda.empty_cache()
    lp = _with_output(settings, folders["layer-parallel"], serial=False,
                      label="layer-parallel")
    if ranks == 1:
        Run(lp).run()
    else:
        folders["layer-parallel"].mkdir(parents=True, exist_ok=True)
        config = folders["layer-parallel"] / "requested-settings.json"
        config.write_text(json.dumps(lp.as_dict(), indent=2))
        # no timeout: the run is as long as the settings make it, and under mpi4py an
        # error on one rank ends them all
        done = launch.run(ranks, ["-m", "mgrit", "train", "--config", str(config)],
                          timeout=None, merge_output=True)
        sys.stderr.write(done.stdout)
        done.check()
    return folders


def summarize(folders: dict[str, Path], ranks: int) -> dict[str, Any]:
    rows = {}
    for label, folder in folders.items():
        steps, epochs = plot.read_metrics(folder)
        last = epochs[-1]
        rows[label] = {"ranks": 1 if label == "serial" else ranks,
                       "epochs": len(epochs), "test_accuracy": last["test_accuracy"],
                       "test_loss": last["test_loss"], "train_loss": last["train_loss"],
                       "seconds_per_step": sum(e["seconds_per_step"] for e in epochs) / len(epochs),
                       "train_seconds": sum(e["seconds"] for e in epochs),
                       # where it ran: versions, hosts, devices
                       "launches": plot.read_records(folder, "launch")}
    serial = rows["serial"]
    for row in rows.values():
        row["accuracy_difference_pp"] = (row["test_accuracy"] - serial["test_accuracy"]) * 100
        row["time_ratio_to_serial"] = row["seconds_per_step"] / serial["seconds_per_step"]
    return rows


def reading(rows: dict[str, Any], settings: Settings) -> str:
    """One sentence on how to read the accuracy table, worded from its numbers."""
    lp = rows["layer-parallel"]
    n, ranks, ratio = settings.network.steps, lp["ranks"], lp["time_ratio_to_serial"]
    gap = abs(lp["accuracy_difference_pp"])
    agree = (f"the test accuracies agree to within {max(gap, 0.01):.2f} points"
             if gap <= 2 else f"the test accuracies differ by {gap:.2f} points, more than "
             "the point or two that MGRIT's inexact solves usually cost")
    speed = f"layer-parallel time per step is {ratio:.2f}x serial's here"
    if ratio > 1 and n <= 64 * ranks:   # the reason only where the layers are few
        speed = (f"layer-parallel time per step is {ratio:.1f}x serial's here because "
                 f"{n} layers on {ranks} ranks leave MGRIT little to parallelize")
    return f"Same data, seed and batch order: {agree}; {speed}."


def describe_network(settings: Settings) -> str:
    """The network of the settings in a few words, for the tables' captions."""
    n = settings.network
    if n.kind == "gpt":
        return (f"GPT (width {n.width}, {n.heads} heads, N = {n.steps} blocks, T = "
                f"{n.t_final}, dropout {n.dropout}, context {settings.data.context})")
    if n.kind == "vit":
        return (f"ViT (width {n.width}, {n.heads} heads, patch {n.patch}, N = {n.steps} "
                f"blocks, T = {n.t_final}, dropout {n.dropout})")
    return f"{n.kind} ResNet (width {n.width}, N = {n.steps}, T = {n.t_final})"


def markdown(rows: dict[str, Any], settings: Settings) -> str:
    t = settings.training
    accuracy = (" Accuracy: of the next-token predictions at every position."
                if settings.network.kind == "gpt" else "")
    # a GPU run's times are not a CPU run's: the caption says where they were taken
    where = "" if t.device == "cpu" else f", on {t.device}"
    lines = [f"Data {settings.data.name}, {describe_network(settings)}, {t.epochs} epochs, "
             f"batch {t.batch_size}, {t.optimizer} lr {t.lr}, seed {t.seed}{where}."
             f"{accuracy}", "",
             "| training | ranks | test accuracy | vs serial (pp) | test loss | ms per step | "
             "time vs serial |", "|---|---|---|---|---|---|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['ranks']} | {r['test_accuracy'] * 100:.2f}% | "
                     f"{r['accuracy_difference_pp']:+.2f} | {r['test_loss']:.4f} | "
                     f"{r['seconds_per_step'] * 1e3:.2f} | {r['time_ratio_to_serial']:.2f} |")
    lines += ["", reading(rows, settings)]
    return "\n".join(lines) + "\n"


def control_summary(folder: Path) -> dict[str, Any] | None:
    """What the controller of a layer-parallel run measured and did (None without one):
    probes, their cost, the median and largest gradient error, the setting at the end and
    every change of setting."""
    probes = plot.read_probes(folder)
    if not probes:
        return None
    errors = sorted(p["error"] for p in probes)
    steps, _ = plot.read_metrics(folder)
    return {"probes": len(probes), "probe_seconds": sum(p["seconds"] for p in probes),
            "median_error": errors[len(errors) // 2], "largest_error": errors[-1],
            "final_setting": steps[-1]["control"]["setting"],
            "decisions": [p["decision"] for p in probes if "decision" in p]}


def control_reading(control: dict[str, Any], settings: Settings) -> str:
    """One sentence on what the controller did, worded from its numbers."""
    changes = control["decisions"]
    moved = ("it kept the configured cycles" if not changes else
             "it changed the setting " + ", ".join(f"at step {d['step']} to {d['to']}"
                                                   for d in changes))
    return (f"Controller (threshold {settings.control.threshold}): {control['probes']} "
            f"probes ({control['probe_seconds']:.2f} s), gradient error median "
            f"{control['median_error']:.3f}, largest {control['largest_error']:.3f}; {moved}; "
            f"setting at the end {control['final_setting']}.")


def figures(folders: dict[str, Path], out: Path) -> list[Path]:
    runs = {label: plot.read_metrics(folder) for label, folder in folders.items()}
    epochs = {label: run[1] for label, run in runs.items()}
    paths = [plot.curves(epochs, "train_loss", "training loss", out / "loss.png"),
             plot.curves(epochs, "test_accuracy", "test accuracy (%)", out / "accuracy.png",
                         percent=True),
             plot.residual_curves(runs["layer-parallel"][0], out / "residuals.png"),
             plot.bars({label: 1e3 * sum(e["seconds_per_step"] for e in ep) / len(ep)
                        for label, ep in epochs.items()}, "ms per training step",
                       out / "step_time.png")]
    probes = plot.read_probes(folders["layer-parallel"])
    if probes:
        settings = json.loads((folders["layer-parallel"] / "settings.json").read_text())
        paths.append(plot.control_curves(runs["layer-parallel"][0], probes,
                                         settings.get("control", {}).get("threshold"),
                                         out / "control.png"))
    return paths


def compare_training(settings: Settings, out: Path, ranks: int) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    folders = train_both(settings, out, ranks)
    rows = summarize(folders, ranks)
    table = markdown(rows, settings)
    control = control_summary(folders["layer-parallel"])
    if control is not None:
        table += "\n" + control_reading(control, settings) + "\n"
    (out / "summary.md").write_text(table)
    paths = figures(folders, out)
    result = {"settings": settings.as_dict(), "runs": rows, "control": control,
              "figures": [p.name for p in paths]}
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    print(table)
    print("figures: " + ", ".join(str(p) for p in paths))
    return result


# what layer-parallel training is for: a deep network ---------------------------------------

# The deep run's solver: DEEP_LEVELS levels coarsened by DEEP_COARSENING, F-relaxation on the
# fine level (mgrit.nn.defaults.training_options), 2 forward cycles and 1 backward. Measured
# on the 2-core development machine, idle (dense tanh ResNet, width 32, N = 1024, digits,
# batch 32, one epoch of 39 steps, mean ms per step on 2 ranks; serial autograd 91-101 ms):
#   levels/m   2/8  2/16  2/32  3/4  3/8  4/4  4/8  5/2
#   ms          26    24    27   30   27   33   30   52
# Two levels with m = 16 is the fastest: each of F-relaxation's 15 steps advances all 64
# intervals (32 per rank) in one batched call, and the 64-step coarse solve is the only
# sequential part, with fewer rank-to-rank synchronizations than deeper hierarchies, whose
# extra levels do not pay for themselves at N = 1024. It is also the most robust to a busy
# machine (24-59 ms while other jobs held the cores, where 3/4 took 37-92 ms and serial
# 95-160 ms), and its solves are as accurate as the default 3 levels of m = 4 (forward
# residual about 0.6 -> 0.03 over the 2 cycles, backward 8e-3). On 1 rank the same solver
# takes ~38 ms per step: the batched calls give most of the gain over serial, the second
# rank the rest.
DEEP_LEVELS = 2
DEEP_COARSENING = 16
DEEP_WIDTH = 32


def deep_settings(settings: Settings, steps: int, levels: int = DEEP_LEVELS,
                  coarsening: int = DEEP_COARSENING) -> Settings:
    """`settings` (data, batch, optimizer, seed) for one epoch of a deep narrow dense ResNet
    with `steps` layers, and the deep run's solver on both passes. No checkpoint, exported
    model or controller: the run is a speed measurement."""
    s = copy.deepcopy(settings)
    s.network.kind = "dense"
    s.network.width = DEEP_WIDTH
    s.network.steps = steps
    s.training.epochs = 1
    s.training.data_parallel = 1
    s.output.checkpoint = False
    s.output.export = False
    s.output.trace = 0
    # the speed of the chosen solver: a controller's first probes would weigh on one short
    # epoch far more than on a training run
    s.control.enabled = False
    for direction in ("forward", "backward"):
        options = training_options(direction, levels, coarsening)
        setattr(s, direction, plain_options(options))
    return s


def deep_reading(rows: dict[str, Any], steps: int) -> str:
    """One sentence on how to read the deep table, worded from its numbers."""
    lp = rows["layer-parallel"]
    ratio, ranks = lp["time_ratio_to_serial"], lp["ranks"]
    head = f"A deep narrow network ({steps} layers): "
    if ratio < 1:
        return (head + "MGRIT advances all intervals of a level in one batched call instead "
                "of stepping through the layers one at a time, so layer-parallel training "
                f"takes {ratio:.2f}x serial's time per step ({1 / ratio:.1f}x faster) on "
                f"{ranks} rank{'s' if ranks > 1 else ''}, and its test accuracy after the "
                "epoch is serial's to within "
                f"{max(abs(lp['accuracy_difference_pp']), 0.01):.2f} points.")
    return (head + f"layer-parallel training took {ratio:.2f}x serial's time per step in "
            "this run: at this depth, or on a busy machine, MGRIT's batched calls do not make "
            "up for its extra work.")


def deep_speed(settings: Settings, out: Path, ranks: int, steps: int) -> dict[str, Any]:
    """One epoch of a deep narrow dense ResNet (`steps` layers, width 32) trained serially
    and layer-parallel on `ranks` ranks (`train_both`, into out/deep/serial and
    out/deep/layer-parallel); ms per training step of each, measured in this run, in
    out/deep.md and out/deep.json, and the table printed."""
    s = deep_settings(settings, steps)
    out.mkdir(parents=True, exist_ok=True)
    folders = train_both(s, out / "deep", ranks)
    rows = {}
    for label, folder in folders.items():
        step_records, epochs = plot.read_metrics(folder)
        last = epochs[-1]
        rows[label] = {"ranks": 1 if label == "serial" else ranks,
                       "training_steps": sum(r["epoch"] == last["epoch"] for r in step_records),
                       "ms_per_step": last["seconds_per_step"] * 1e3,
                       "test_accuracy": last["test_accuracy"], "test_loss": last["test_loss"]}
    serial = rows["serial"]
    for row in rows.values():
        row["time_ratio_to_serial"] = row["ms_per_step"] / serial["ms_per_step"]
        row["accuracy_difference_pp"] = (row["test_accuracy"] - serial["test_accuracy"]) * 100
    ratio = rows["layer-parallel"]["time_ratio_to_serial"]
    fwd, bwd = s.solver("forward"), s.solver("backward")
    lines = [f"Deep network: data {s.data.name}, dense ResNet (width {s.network.width}, "
             f"N = {steps}, T = {s.network.t_final}), 1 epoch ({serial['training_steps']} "
             f"steps, batch {s.training.batch_size}), seed {s.training.seed}; MGRIT "
             f"{fwd.levels} levels, m = {fwd.coarsening_at(0)}, {fwd.max_iter} forward and "
             f"{bwd.max_iter} backward cycle{'s' if bwd.max_iter > 1 else ''}.", "",
             "| training | ranks | ms per step | time vs serial | test accuracy |",
             "|---|---|---|---|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['ranks']} | {r['ms_per_step']:.1f} | "
                     f"{r['time_ratio_to_serial']:.2f} | {r['test_accuracy'] * 100:.2f}% |")
    lines += ["", deep_reading(rows, steps)]
    table = "\n".join(lines) + "\n"
    (out / "deep.md").write_text(table)
    result = {"settings": s.as_dict(), "steps": steps, "runs": rows,
              "layer_parallel_to_serial": ratio,
              "folders": {label: str(folder) for label, folder in folders.items()}}
    (out / "deep.json").write_text(json.dumps(result, indent=2))
    print(table)
    return result


# convergence of the solver alone -------------------------------------------------------

STUDY_SETTINGS = [(relax, m, levels) for relax in ("F", "FCF") for m in (2, 4, 8)
                  for levels in (2, 3, 4, 5)]


def _history(prop: Any, u0: torch.Tensor, num_steps: int, t1: float, relax: str, m: int,
             levels: int, cycles: int) -> list[float]:
    cfg = Config(levels=levels, coarsening=m, relax=relax, tol=0.0, max_iter=cycles,
                 min_coarse=1, divergence_factor=1e8)
    try:
        return solve(prop, u0, num_steps, 0.0, t1, cfg).residuals
    except DivergenceError as err:
        return err.residuals


def trained_layers(model_path: Path, sample: torch.Tensor
                   ) -> tuple[ModuleResNet, torch.Tensor, int, float] | None:
    """The residual layers of an exported network (`model.pt`) as a float64 propagator, with
    its opening applied to `sample` as the initial state."""
    from ..nn import ResidualStep

    if not model_path.exists():
        return None
    # evaluation mode: dropout would make every evaluation of a layer another function
    net = torch.load(model_path, weights_only=False).double().eval()
    steps = [m for m in net if isinstance(m, ResidualStep)]
    if not steps:
        return None
    with torch.no_grad():
        # token ids (a language model's input) stay integers
        u0 = net[0](sample.double() if sample.is_floating_point() else sample)
    return ModuleResNet([s.f for s in steps]), u0, len(steps), steps[0].h * len(steps)


def solver_study(out: Path, cycles: int = 10, network: Path | None = None,
                 sample: torch.Tensor | None = None) -> dict[str, Any]:
    """Residual against cycle for relax F/FCF, coarsening 2/4/8 and 2-5 levels on Dahlquist
    (u' = -u, backward Euler, N = 1024), the heat equation (nx = 65, N = 512) and, given an
    exported network and an input batch, that network's trained layers."""
    out.mkdir(parents=True, exist_ok=True)
    heat = Heat1D.sine_solution(65)
    problems = {"dahlquist": (Dahlquist(-1.0), torch.tensor(1.0, dtype=torch.float64), 1024, 50.0),
                "heat": (heat, heat.initial_sine(), 512, 2.0)}
    if network is not None and sample is not None:
        found = trained_layers(network, sample)
        if found is not None:
            problems["trained network"] = found
    study: dict[str, list[dict[str, Any]]] = {}
    for name, (prop, u0, n, t1) in problems.items():
        runs = []
        for relax, m, levels in STUDY_SETTINGS:
            if n // m ** (levels - 1) < 1:
                continue
            r = _history(prop, u0, n, t1, relax, m, levels, cycles)
            factor = (r[-1] / r[0]) ** (1 / max(len(r) - 1, 1)) if r and r[0] > 0 else math.nan
            runs.append({"label": f"{relax} m={m} L={levels}", "relax": relax, "coarsening": m,
                         "levels": levels, "residuals": r, "mean_factor": factor})
        study[name] = runs
    path = plot.convergence_grid(study, out / "convergence.png")
    (out / "convergence.json").write_text(json.dumps(study, indent=2))
    lines = ["| problem | relax | m | levels | cycles | last residual | mean factor |",
             "|---|---|---|---|---|---|---|"]
    for name, runs in study.items():
        for run in runs:
            r = run["residuals"]
            lines.append(f"| {name} | {run['relax']} | {run['coarsening']} | {run['levels']} | "
                         f"{len(r)} | {r[-1]:.2e} | {run['mean_factor']:.3f} |")
    (out / "convergence.md").write_text("\n".join(lines) + "\n")
    print(f"convergence study: {path}, {out / 'convergence.md'}")
    return study
