"""Figures of training comparisons and solver convergence studies (PNG, via matplotlib)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _all_records(folder: str | Path) -> list[dict]:
    """Every record of a run's metrics.jsonl, in order."""
    return [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def read_metrics(folder: str | Path) -> tuple[list[dict], list[dict]]:
    """(step records, epoch records) of a run's metrics.jsonl."""
    records = _all_records(folder)
    return ([r for r in records if r["type"] == "step"],
            [r for r in records if r["type"] == "epoch"])


def read_records(folder: str | Path, kind: str) -> list[dict]:
    """The records of type `kind` of a run's metrics.jsonl."""
    return [r for r in _all_records(folder) if r["type"] == kind]


def read_probes(folder: str | Path) -> list[dict]:
    """The probe records of a run's metrics.jsonl (none without a controller)."""
    return read_records(folder, "probe")


def control_curves(steps: list[dict], probes: list[dict], threshold: float | None,
                   path: Path) -> Path:
    """Top: the gradient error against the training step, as probes measured it (relative
    error of the training gradient against the exact one) and as the controller estimated
    it between probes, with the threshold and the changes of setting. Bottom: forward and
    backward cycles and levels per step."""
    plt = _pyplot()
    # constrained layout makes room for what sits outside the axes: the decisions' labels
    # above the top panel and the legends on the right
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, layout="constrained")
    estimated = [(s["step"], s["control"]["estimate"]) for s in steps
                 if s.get("control", {}).get("estimate")]
    if estimated:
        top.semilogy(*zip(*estimated), lw=0.7, color="tab:gray", label="estimate")
    measured = [(p["step"], p["error"]) for p in probes if p["error"] > 0]
    if measured:
        top.semilogy(*zip(*measured), "o", ms=3.5, color="tab:blue", label="probe")
    if threshold is not None:
        top.axhline(threshold, ls="--", color="tab:red", lw=1, label="threshold")
    shown = [e for _, e in estimated + measured] + ([threshold] if threshold else [])
    if shown:
        # the threshold and the extreme probes a little inside the frame, not on it
        top.set_ylim(min(shown) / 1.3, max(shown) * 1.3)
    for p in probes:
        if "decision" in p:
            top.axvline(p["step"], color="tab:green", lw=0.6, alpha=0.6)
            # above the panel, where they cross no curve and the layout keeps them whole
            top.annotate(p["decision"]["to"], (p["step"], 1.02), xycoords=("data", "axes fraction"),
                         rotation=90, va="bottom", ha="center", fontsize=7, color="tab:green",
                         annotation_clip=False)
    top.set_ylabel("gradient relative error")
    top.grid(alpha=0.3, which="both")
    top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    numbers = [s["step"] for s in steps]
    cycles = {"forward cycles": [len(s["forward_residuals"]) for s in steps],
              "backward cycles": [len(s["backward_residuals"]) for s in steps]}
    if all("control" in s for s in steps):
        cycles = {"forward cycles": [s["control"]["forward_cycles"] for s in steps],
                  "backward cycles": [s["control"]["backward_cycles"] for s in steps],
                  "levels": [s["control"]["levels"] for s in steps]}
    # equal counts would hide one line behind another: each has a style of its own
    styles = {"forward cycles": ("-", 3.0), "backward cycles": ("--", 1.8), "levels": (":", 1.8)}
    for label, values in cycles.items():
        ls, lw = styles[label]
        bottom.step(numbers, values, where="post", ls=ls, lw=lw, label=label)
    bottom.set_xlabel("training step")
    bottom.set_ylabel("per step")
    bottom.yaxis.get_major_locator().set_params(integer=True)
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def curves(runs: dict[str, list[dict]], key: str, ylabel: str, path: Path,
           percent: bool = False) -> Path:
    """One line per run: `key` of the epoch records against the epoch."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8), layout="constrained")
    # runs that agree would draw one line over another: the first is wide and solid, each
    # later one narrower, dashed and drawn above it, so every run stays visible
    styles = [("-", "o", 3.2), ("--", "s", 1.6), (":", "^", 1.2), ("-.", "v", 1.0)]
    for n, (label, epochs) in enumerate(runs.items()):
        ls, marker, lw = styles[n % len(styles)]
        values = [e[key] * (100 if percent else 1) for e in epochs]
        ax.plot([e["epoch"] for e in epochs], values, ls=ls, lw=lw, marker=marker,
                ms=7 - 1.5 * min(n, 2), mfc="none" if n else None, zorder=2 + n, label=label)
    ax.set_xlabel("epoch")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def residual_curves(steps: list[dict], path: Path) -> Path:
    """Top: residual against cycle of the forward and backward solves (median over all
    training steps, first and last step). Bottom: the last cycle's residual against the
    training step."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5))
    for col, kind in enumerate(("forward", "backward")):
        top, bottom = axes[0][col], axes[1][col]
        histories = [s[f"{kind}_residuals"] for s in steps if s[f"{kind}_residuals"]]
        if histories:
            cycles = max(len(h) for h in histories)
            median = [statistics.median(h[k] for h in histories if len(h) > k)
                      for k in range(cycles)]
            top.semilogy(range(1, cycles + 1), median, marker="o", label="median over steps")
            top.semilogy(range(1, len(histories[0]) + 1), histories[0], marker="s", ls="--",
                         label="first step")
            top.semilogy(range(1, len(histories[-1]) + 1), histories[-1], marker="^", ls=":",
                         label="last step")
            top.legend()
            bottom.semilogy([s["step"] for s in steps if s[f"{kind}_residuals"]],
                            [h[-1] for h in histories], lw=0.8)
        top.set_title(f"{kind} solve")
        top.set_xlabel("cycle")
        top.set_ylabel("residual")
        top.set_xticks(range(1, max((len(h) for h in histories), default=1) + 1))
        bottom.set_xlabel("training step")
        bottom.set_ylabel("residual after the last cycle")
        for ax in (top, bottom):
            ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def bars(values: dict[str, float], ylabel: str, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.5, 3.5))
    ax.bar(list(values), list(values.values()), color=["tab:blue", "tab:orange", "tab:green"][:len(values)])
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def convergence_grid(study: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    """One panel per problem: residual against cycle for every solver setting studied."""
    plt = _pyplot()
    problems = list(study)
    fig, axes = plt.subplots(1, len(problems), figsize=(5.5 * len(problems), 5), squeeze=False)
    for ax, name in zip(axes[0], problems):
        for run in study[name]:
            r = run["residuals"]
            if r:
                ax.semilogy(range(1, len(r) + 1), r, lw=1, label=run["label"])
        ax.set_title(name)
        ax.set_xlabel("cycle")
        ax.set_ylabel("residual")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
