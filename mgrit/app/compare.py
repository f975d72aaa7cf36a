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
from ..problems import Dahlquist, Heat1D, ModuleResNet
from .settings import Settings
from .train import Run


def _with_output(settings: Settings, folder: Path, serial: bool) -> Settings:
    s = copy.deepcopy(settings)
    s.output.dir = str(folder)
    s.training.serial = serial
    return s


def train_both(settings: Settings, out: Path, ranks: int) -> dict[str, Path]:
    """Serial training in this process; layer-parallel training here (1 rank) or under
    `mpiexec -n ranks`. Same seed, same data order."""
    folders = {"serial": out / "serial", "layer-parallel": out / "layer-parallel"}
    Run(_with_output(settings, folders["serial"], serial=True)).run()
    lp = _with_output(settings, folders["layer-parallel"], serial=False)
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
                       "train_seconds": sum(e["seconds"] for e in epochs)}
    serial = rows["serial"]
    for row in rows.values():
        row["accuracy_difference_pp"] = (row["test_accuracy"] - serial["test_accuracy"]) * 100
        row["time_ratio_to_serial"] = row["seconds_per_step"] / serial["seconds_per_step"]
    return rows


def markdown(rows: dict[str, Any], settings: Settings) -> str:
    t, n = settings.training, settings.network
    lines = [f"Data {settings.data.name}, {n.kind} ResNet (width {n.width}, N = {n.steps}, "
             f"T = {n.t_final}), {t.epochs} epochs, batch {t.batch_size}, {t.optimizer} "
             f"lr {t.lr}, seed {t.seed}.", "",
             "| training | ranks | test accuracy | vs serial (pp) | test loss | ms per step | "
             "time vs serial |", "|---|---|---|---|---|---|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['ranks']} | {r['test_accuracy'] * 100:.2f}% | "
                     f"{r['accuracy_difference_pp']:+.2f} | {r['test_loss']:.4f} | "
                     f"{r['seconds_per_step'] * 1e3:.2f} | {r['time_ratio_to_serial']:.2f} |")
    return "\n".join(lines) + "\n"


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
    return paths


def compare_training(settings: Settings, out: Path, ranks: int) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    folders = train_both(settings, out, ranks)
    rows = summarize(folders, ranks)
    table = markdown(rows, settings)
    (out / "summary.md").write_text(table)
    paths = figures(folders, out)
    result = {"settings": settings.as_dict(), "runs": rows,
              "figures": [p.name for p in paths]}
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    print(table)
    print("figures: " + ", ".join(str(p) for p in paths))
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
    net = torch.load(model_path, weights_only=False).double()
    steps = [m for m in net if isinstance(m, ResidualStep)]
    if not steps:
        return None
    with torch.no_grad():
        u0 = net[0](sample.double())
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
