"""Counting the work of a training step: layer evaluations, observed, not derived.

While `counting()` is entered, every step the solver asks of a network's forward
(`NetworkPropagator`) or adjoint (`AdjointPropagator`) propagator is counted, by direction
and level, whatever path runs it: one step, a batch, a compiled phase. A coarse step costs
one layer evaluation like a fine one (it applies one layer with a longer dt), so the sum
over levels is the step's work in fine-equivalent evaluations, and sequential stepping's
is N forward and N adjoint. Separately counted: the op outputs the adjoint computes again
for layers whose forward values were not kept (`values`), a forward evaluation hidden in
the backward pass.

    python -m benchmarks.work [w1 w2 ...]      # counts per workload, MGRIT and levels=1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
from collections import Counter
from typing import Any, Callable, Iterator

import torch

from mgrit.core.propagator import Step
from mgrit.kernels import strategies
from mgrit.nn.engine import adjoint, propagators

_lock = threading.Lock()
_local = threading.local()      # depth of counted calls: a call made by one is not counted


class Work:
    """Counts of layer evaluations: `steps[(direction, level)]`, `values` (adjoint
    recomputations of forward op outputs) and `nonzero_adjoint`: the adjoint steps whose
    cotangent was not all zeros, the only ones that cost arithmetic (the adjoint is linear;
    the kernels skip the others)."""

    def __init__(self) -> None:
        self.steps: Counter = Counter()
        self.values = 0
        self.nonzero_adjoint = 0

    def reset(self) -> None:
        self.steps.clear()
        self.values = 0
        self.nonzero_adjoint = 0

    def total(self, direction: str) -> int:
        return sum(n for (d, _), n in self.steps.items() if d == direction)

    def by_level(self, direction: str) -> dict[int, int]:
        return dict(sorted((lv, n) for (d, lv), n in self.steps.items() if d == direction))

    def record(self) -> dict[str, Any]:
        return {"forward": self.total("forward"), "adjoint": self.total("adjoint"),
                "forward_by_level": self.by_level("forward"),
                "adjoint_by_level": self.by_level("adjoint"), "values": self.values,
                "adjoint_nonzero": self.nonzero_adjoint}


def _add(work: Work, direction: str, level: int, n: int, nonzero: int = 0) -> None:
    with _lock:
        work.steps[direction, level] += n
        if direction == "adjoint":
            work.nonzero_adjoint += nonzero


def _nonzero(x: Any, batched: bool) -> int:
    """Entries of a cotangent (rows of a batch) that are not all zeros."""
    if batched:
        return int(x.reshape(x.shape[0], -1).ne(0).any(1).sum())
    return int(bool(x.ne(0).any()))


def _outermost(work: Work, direction: str, fn: Callable, size: Callable[..., tuple[int, int]]
               ) -> Callable:
    """`fn` counted by `size(*args) -> (level, steps)` unless a counted call made it."""
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_local, "depth", 0)
        level, n = size(*args)
        nonzero = (_nonzero(args[0], not isinstance(args[1], Step))
                   if depth == 0 and direction == "adjoint" else 0)
        _local.depth = depth + 1
        try:
            result = fn(self, *args, **kwargs)
        finally:
            _local.depth = depth
        if depth == 0:
            _add(work, direction, level, n, nonzero)
        return result
    return counted


def _program(work: Work, direction: str, fn: Callable) -> Callable:
    """`step_program` whose compiled phase counts its steps each time it runs."""
    def made(self: Any, steps: list, rows: list, parallel: int) -> Any:
        program = fn(self, steps, rows, parallel)
        if program is None:
            return None
        level, count = steps[0].level, len(steps)

        def run() -> None:
            depth = getattr(_local, "depth", 0)
            _local.depth = depth + 1
            try:
                program()
            finally:
                _local.depth = depth
            if depth == 0:
                # read after the call: a phase's later steps take what its earlier wrote
                nonzero = (sum(_nonzero(row[0], False) for row in rows)
                           if direction == "adjoint" else 0)
                _add(work, direction, level, count, nonzero)
        return run
    return made


def _values(work: Work, fn: Callable, layers: Callable[..., int]) -> Callable:
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _lock:
            work.values += layers(*args)
        return fn(self, *args, **kwargs)
    return counted


@contextlib.contextmanager
def counting() -> Iterator[Work]:
    """While entered, count the layer evaluations of every MGRIT solve of a network.
    Enter it before the model runs its first pass: compiled phases made outside are not
    counted."""
    work = Work()
    one = lambda u, s, *rest: (s.level, 1)  # noqa: E731
    batch = lambda x, steps, *rest: (steps.level, steps.count)  # noqa: E731
    patches: list[tuple[Any, str, Any]] = []
    for cls, direction in ((propagators.NetworkPropagator, "forward"),
                           (adjoint.AdjointPropagator, "adjoint")):
        for name, size in (("step", one), ("step_into", one), ("step_batch", batch),
                           ("step_batch_into", batch)):
            if name in vars(cls):
                patches.append((cls, name, _outermost(work, direction, vars(cls)[name], size)))
        patches.append((cls, "step_program", _program(work, direction,
                                                       vars(cls)["step_program"])))
    classes, todo = [], [strategies.ChainSteps]
    while todo:                 # every strategy class, subclasses of subclasses included
        classes.append(todo.pop())
        todo += classes[-1].__subclasses__()
    for cls in classes:
        if "values" in vars(cls):
            patches.append((cls, "values", _values(work, vars(cls)["values"],
                                                   lambda t, us, *r: len(us))))
        if "single_values" in vars(cls):
            patches.append((cls, "single_values", _values(work, vars(cls)["single_values"],
                                                          lambda *a: 1)))
    saved = [(obj, name, obj.__dict__[name]) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        yield work
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def step_work(work_load: Any, comm: Any = None) -> dict[str, Any]:
    """Layer evaluations of one training step and of one forward pass (no gradients) of
    a `TrainingWorkload` on this process's rank, counted on a fresh model after one
    untimed step and pass (solver storage and compiled phases made inside the count, and
    the solvers' one-off check of the step outside it)."""
    from .training import forward_fn, parallel_model, train_step_fn

    with counting() as work:
        model = parallel_model(work_load, comm=comm)
        x, y = work_load.inputs(torch.Generator().manual_seed(1))
        step = train_step_fn(model, work_load, x, y)
        step()
        work.reset()
        step()
        train = work.record()
        one_pass = forward_fn(model, x)
        one_pass()       # a pass without gradients has solvers of its own: their first
        work.reset()    # solve checks the step once, outside the work of a pass
        one_pass()
        forward = work.record()
    return {"train_step": train, "forward": forward, "num_steps": model.num_steps}


def ratios(counts: dict[str, Any]) -> dict[str, float]:
    """Evaluations relative to sequential stepping (N forward, N adjoint; a forward pass:
    N), of a `step_work` result."""
    n = counts["num_steps"]
    train, fwd = counts["train_step"], counts["forward"]
    return {"train_forward": train["forward"] / n, "train_adjoint": train["adjoint"] / n,
            "train_values": train["values"] / n,
            "train_adjoint_nonzero": train["adjoint_nonzero"] / n,
            "train_total": (train["forward"] + train["adjoint"] + train["values"]) / (2 * n),
            # what costs arithmetic: the adjoint's zero cotangents map to zero for free
            "train_arithmetic": (train["forward"] + train["adjoint_nonzero"] + train["values"])
            / (2 * n),
            "forward": fwd["forward"] / n}


def main(argv: list[str] | None = None) -> None:
    from .training import sequential_variant
    from .workloads import TRAINING_WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", nargs="*", default=["w1", "w2"],
                        choices=sorted(TRAINING_WORKLOADS))
    parser.add_argument("--json", help="also write the counts here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = []
    for name in args.workloads:
        wl = TRAINING_WORKLOADS[name]()
        for label, w in (("mgrit", wl), ("sequential", sequential_variant(wl))):
            counts = step_work(w)
            rec = {"workload": name, "method": label, **counts, "ratios": ratios(counts)}
            out.append(rec)
            r = rec["ratios"]
            print(f"{name} {label:>10}: train step fwd {r['train_forward']:.2f} N "
                  f"{counts['train_step']['forward_by_level']}, adj {r['train_adjoint']:.2f} N "
                  f"{counts['train_step']['adjoint_by_level']} (non-zero {r['train_adjoint_nonzero']:.2f} N), values {r['train_values']:.2f}"
                  f" N; forward pass {r['forward']:.2f} N {counts['forward']['forward_by_level']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
