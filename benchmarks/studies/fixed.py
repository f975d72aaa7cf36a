"""Where one rank's training step goes, phase by phase: W2's step in this process on one rank
with as many layers as a rank holds at a given rank count (64: W2 on 16 ranks; W2's
hierarchy needs 64 layers at least), docs/performance.md, "A step's fixed costs". The
costs that do not shrink with a rank's layers (set-up of a pass, the checks, the loss and
autograd's start, the assembly of gradients) are the ones every rank pays at every rank
count; this splits the step at the solver's own boundaries (solve, cycle, residual) and
at the training step's (zero_grad, forward, loss, backward, update), and prints the median
of each span over the timed steps, and the mean step with its page faults (docs/performance.md,
"Host memory").

    python -m benchmarks.studies.fixed [--layers 64] [--steps 300] [--sequential] [--json PATH]

Question: which costs of a rank's training step do not shrink with its layers?
Answer: at 64 layers, the spans outside the forward cycles and the adjoint's solve (the
passes' set-up, the checks, the loss, autograd's start, gradient assembly, the update) are
484 of the step's 831 us. Result: the table in docs/performance.md, "A step's fixed costs"
(recorded there only).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import resource
import statistics
import time
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch

from mgrit.core.cycle import Solver
from mgrit.nn import layer_parallel

from ..scaling.cases import setup, shared_model
from ..training import sequential_variant
from ..workloads import TRAINING_WORKLOADS, w2

# the solver's boundaries that split a step: (owner, method, label)
BOUNDARIES = ((Solver, "_solve", "solve"), (Solver, "_run_cycle", "cycle"),
              (Solver, "_local_residual", "residual"),
              (layer_parallel, "layer_gradients", "gradients"))


@contextlib.contextmanager
def _marked(marks: list[tuple[str, float]]) -> Iterator[None]:
    """Each boundary's entry and exit appended to `marks` (label, time) while entered."""
    saved = []
    for owner, name, label in BOUNDARIES:
        original = getattr(owner, name)
        saved.append((owner, name, original))

        def wrapped(*args: Any, _f: Callable = original, _l: str = label, **kw: Any) -> Any:
            marks.append((_l + " begins", time.perf_counter()))
            try:
                return _f(*args, **kw)
            finally:
                marks.append((_l + " ends", time.perf_counter()))
        setattr(owner, name, functools.wraps(original)(wrapped))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def measure(layers: int = 64, steps: int = 300, warmup: int = 50, sequential: bool = False
            ) -> dict[str, Any]:
    """Medians (seconds) of the spans between consecutive marks of W2's training step with
    `layers` layers on one rank (MGRIT's reference setting, or sequential stepping), over
    `steps` steps after `warmup`."""
    work = TRAINING_WORKLOADS["w2"]()
    if sequential:
        work = sequential_variant(work)
    work = replace(work, network=lambda: w2(num_steps=layers))
    net, built, x, y = setup(work)
    model = shared_model(work, net, built, None)
    optimizer = work.optimizer(model.parameters())
    marks: list[tuple[str, float]] = []
    spans: dict[str, list[float]] = {}
    totals = []
    faults = 0
    with _marked(marks):
        for k in range(warmup + steps):
            marks.clear()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            marks.append(("step begins", time.perf_counter()))
            optimizer.zero_grad()
            marks.append(("gradients zeroed", time.perf_counter()))
            out = model(x)
            marks.append(("forward pass done", time.perf_counter()))
            loss = work.loss(out, y)
            marks.append(("loss computed", time.perf_counter()))
            loss.backward()
            marks.append(("backward pass done", time.perf_counter()))
            optimizer.step()
            marks.append(("update done", time.perf_counter()))
            if k < warmup:
                continue
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            totals.append(marks[-1][1] - marks[0][1])
            for i in range(1, len(marks)):
                key = f"{i:02d} {marks[i - 1][0]} -> {marks[i][0]}"
                spans.setdefault(key, []).append(marks[i][1] - marks[i - 1][1])
    return {"layers": layers, "steps": steps, "sequential": sequential, "torch": torch.__version__,
            "step": statistics.median(totals), "mean": statistics.mean(totals),
            "faults": faults / steps,
            "spans": {key: statistics.median(v) for key, v in spans.items()}}


def table(result: dict[str, Any]) -> str:
    lines = ["| span | median (us) |", "| --- | ---: |"]
    for key, seconds in result["spans"].items():
        lines.append(f"| {key[3:]} | {seconds * 1e6:.1f} |")
    lines.append(f"| whole step (median) | {result['step'] * 1e6:.1f} |")
    lines.append(f"| whole step (mean; {result['faults']:.1f} page faults a step) | "
                 f"{result['mean'] * 1e6:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.fixed",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=64,
                        help="W2's layers on the one rank (1024 / ranks)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sequential", action="store_true",
                        help="sequential stepping (levels=1) instead of MGRIT's W2 setting")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    result = measure(args.layers, args.steps, sequential=args.sequential)
    how = "sequential stepping" if args.sequential else "MGRIT's reference setting"
    print(f"W2 ({how}) with {args.layers} layers on one rank, torch {result['torch']}, median of "
          f"{args.steps} steps\n")
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
