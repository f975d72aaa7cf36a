"""Cheaper solver settings for a training step, measured against sequential stepping: for
each setting, the layer evaluations (`benchmarks.work`), the wall time of a training step
and of a forward pass, and the gradient's error against sequential stepping's (levels=1,
the exact gradient to rounding), all as ratios taken in one run, one rank.

    python -m benchmarks.settings [w1 w2] [--rounds R] [--json PATH]

Timing rounds alternate the settings (one call of each per round, after a warm-up), so a
noisy phase of the machine touches them alike; the table gives the median and the minimum.
Warm-started settings (initial_guess "warm": each solve starts from the previous step's
states) are measured after a few training steps, as every setting's gradient is.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from mgrit.app.environment import source_commit
from mgrit.core.config import Config
from mgrit.nn.defaults import training_options

from .training import forward_fn, parallel_model, train_step_fn
from .work import ratios, step_work
from .workloads import TRAINING_WORKLOADS, TrainingWorkload

WARMUP_STEPS = 3        # training steps before the gradient is compared (warm starts settle)


@dataclass(frozen=True)
class Setting:
    """A forward and a backward solve's options: `levels`, coarsening `m`, relaxation per
    level above the coarsest (`relax`: one kind for all, or "F/FCF" for F on the fine level
    and FCF below), cycle kind, cycles each way and whether both solves start warm."""

    name: str
    levels: int
    m: int = 4
    relax: str = "F/FCF"
    cycle: str = "V"
    forward: int = 2
    backward: int = 1
    warm: bool = False

    def config(self, cycles: int) -> Config:
        if self.levels == 1:
            return Config(levels=1, tol=0.0, max_iter=1)
        options = training_options("forward", self.levels, self.m)
        relax = (options["relax"] if self.relax == "F/FCF"
                 else (self.relax,) * (self.levels - 1))
        return Config(**{**options, "relax": relax, "max_iter": cycles, "cycle": self.cycle,
                         "initial_guess": "warm" if self.warm else "zero"})

    def apply(self, work: TrainingWorkload) -> TrainingWorkload:
        return replace(work, forward=self.config(self.forward),
                       backward=self.config(self.backward))


def candidates(levels: int, num_steps: int | None = None) -> list[Setting]:
    """Sequential stepping, the workload's default (`levels` levels) and one change at a
    time from it; with `num_steps`, a coarsening that the network's depth cannot take at
    that many levels gets one level fewer, and more levels than it can take are left out."""
    base = Setting("default", levels)
    out = _candidates(base, levels)
    if num_steps is None:
        return out
    fits = lambda s: num_steps % s.m ** (s.levels - 1) == 0  # noqa: E731
    fitted = []
    for s in out:
        if not fits(s) and s.m != base.m:
            s = replace(s, name=f"{s.name}, {s.levels - 1} levels", levels=s.levels - 1)
        if fits(s):
            fitted.append(s)
    return fitted


def _candidates(base: Setting, levels: int) -> list[Setting]:
    return [Setting("sequential (levels=1)", 1), base,
            replace(base, name="1 forward cycle", forward=1),
            replace(base, name="1 forward cycle, warm", forward=1, warm=True),
            replace(base, name="2 forward cycles, warm", warm=True),
            replace(base, name="F on every level", relax="F"),
            replace(base, name="FCF on every level", relax="FCF"),
            replace(base, name="F-cycle", cycle="F"),
            replace(base, name="F-cycle, 1 forward cycle", cycle="F", forward=1),
            replace(base, name="2 levels", levels=2),
            *([replace(base, name="3 levels", levels=3)] if levels > 3 else []),
            replace(base, name=f"{levels + 1} levels", levels=levels + 1),
            replace(base, name="coarsening 2", m=2),
            replace(base, name="coarsening 8", m=8),
            replace(base, name="2 backward cycles", backward=2)]


def _batches(work: TrainingWorkload, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [work.inputs(g) for _ in range(count)]


def gradient_error(work: TrainingWorkload, setting: Setting) -> dict[str, float]:
    """Relative error and cosine of the setting's gradient against sequential stepping's at
    the same weights, after WARMUP_STEPS training steps of the setting (its warm states
    come from them); the forward output's relative error too."""
    model = parallel_model(setting.apply(work))
    exact = parallel_model(Setting("sequential", 1).apply(work))
    batches = _batches(work, WARMUP_STEPS + 1)
    optimizer = work.optimizer(model.parameters())
    for x, y in batches[:-1]:
        optimizer.zero_grad()
        work.loss(model(x), y).backward()
        optimizer.step()
    exact.load_state_dict(model.state_dict())
    x, y = batches[-1]
    outputs = []
    for net in (model, exact):
        net.zero_grad()
        out = net(x)
        work.loss(out, y).backward()
        outputs.append(out.detach())
    pairs = [(a.grad, b.grad) for a, b in zip(model.parameters(), exact.parameters())
             if b.grad is not None]
    dot = sum(float((a * b).sum()) for a, b in pairs)
    na = sum(float(a.pow(2).sum()) for a, _ in pairs)
    nb = sum(float(b.pow(2).sum()) for _, b in pairs)
    diff = sum(float((a - b).pow(2).sum()) for a, b in pairs)
    return {"relative_error": (diff / nb) ** 0.5, "cosine": dot / (na * nb) ** 0.5,
            "output_relative_error": float((outputs[0] - outputs[1]).norm()
                                           / outputs[1].norm())}


def measure(name: str, rounds: int) -> list[dict[str, Any]]:
    """Every candidate of workload `name`: counts, times (alternated rounds), errors."""
    work = TRAINING_WORKLOADS[name]()
    settings = candidates(work.forward.levels, work.network().num_steps)
    runs = []
    for s in settings:
        w = s.apply(work)
        model = parallel_model(w)
        batches = _batches(work, WARMUP_STEPS)
        x, y = batches[-1]
        step = train_step_fn(model, w, x, y)
        for bx, by in batches:       # warm states, solver storage, compiled phases
            train_step_fn(model, w, bx, by)()
        runs.append({"step": step, "forward": forward_fn(model, x), "times": {
            "train_step": [], "forward": []}})
        runs[-1]["forward"]()
    # every setting's model stays alive for the alternation: the cyclic collector, left on,
    # would walk all their objects at moments that land on one setting or another
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            for run in runs:
                for metric in ("train_step", "forward"):
                    start = time.perf_counter()
                    run["step" if metric == "train_step" else "forward"]()
                    run["times"][metric].append(time.perf_counter() - start)
            gc.collect()
    finally:
        gc.enable()
    seq = runs[0]["times"]
    base = {m: statistics.median(seq[m]) for m in seq}
    records = []
    for s, run in zip(settings, runs):
        counts = step_work(s.apply(work))
        times = run["times"]
        records.append({
            "workload": name, "setting": s.name, **vars(s),
            "evaluations": counts, "evaluation_ratios": ratios(counts),
            "seconds": {m: {"median": statistics.median(t), "min": min(t)}
                        for m, t in times.items()},
            "time_ratios": {m: statistics.median(t) / base[m] for m, t in times.items()},
            "min_time_ratios": {m: min(t) / min(seq[m]) for m, t in times.items()},
            "gradient": gradient_error(work, s)})
    return records


def table(records: list[dict[str, Any]]) -> str:
    """The markdown table of `measure`'s records: ratios to sequential stepping."""
    rows = ["| workload | setting | evals step | evals fwd | time step (med / min) | "
            "time fwd (med / min) | grad rel. error | output rel. error |",
            "| --- | --- |" + " ---: |" * 6]
    for r in records:
        e, t, tm, g = (r["evaluation_ratios"], r["time_ratios"], r["min_time_ratios"],
                       r["gradient"])
        rows.append(f"| {r['workload']} | {r['setting']} | {e['train_total']:.2f} | "
                    f"{e['forward']:.2f} | {t['train_step']:.2f} / {tm['train_step']:.2f} | "
                    f"{t['forward']:.2f} / {tm['forward']:.2f} | {g['relative_error']:.1e} | "
                    f"{g['output_relative_error']:.1e} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", nargs="*", default=["w1", "w2"],
                        choices=sorted(TRAINING_WORKLOADS))
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (alternated)")
    parser.add_argument("--json", help="also write the records here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    torch.set_num_threads(1)
    records = [r for name in args.workloads for r in measure(name, args.rounds)]
    print("Ratios to sequential stepping (levels=1, same kernels), one rank, one thread; "
          "evals: layer evaluations (a coarse step counts as one); gradient error against "
          f"sequential stepping's after {WARMUP_STEPS} training steps")
    print(table(records))
    if args.json:
        commit = source_commit()
        with open(args.json, "w") as f:
            json.dump({"command": "python -m benchmarks.settings " + " ".join(sys.argv[1:] if argv is None else argv),
                       "commit": commit, "torch": torch.__version__, "records": records}, f,
                      indent=1)


if __name__ == "__main__":
    main()
