"""Where one rank's training step goes, phase by phase: W2's step in this process on one rank
with as many layers as a rank holds at a given rank count (64: W2 on 16 ranks; W2's
hierarchy needs 64 layers at least), docs/performance.md, "A step's fixed costs". The
costs that do not shrink with a rank's layers (set-up of a pass, the checks, the loss and
autograd's start, the assembly of gradients) are the ones every rank pays at every rank
count; this splits the step at the solver's own boundaries (solve, cycle, residual) and
at the training step's (zero_grad, forward, loss, backward, update), and prints the median
of each span over the timed steps, and the mean step with its page faults (docs/performance.md,
"Host memory").

    python -m benchmarks.studies.fixed [--layers 64] [--steps 300] [--sequential | --nested]
                                       [--fine] [--json PATH]
    python -m benchmarks.studies.fixed --layers 16 --torch-part [--steps 100]
    mpiexec -n 2 python -m mpi4py -m benchmarks.studies.fixed --layers 1024 --nested --fine

Under mpiexec the network's layers are spread over the ranks, every step starts after a
barrier, and the table has a column per rank: where a 2-rank step of the setting
`mgrit bench` chooses for W2 on 2 ranks (`--nested`: 2 levels, m = 16, no cycle from nested
starts) spends what sequential stepping on one rank does not (docs/performance.md, "Two
ranks against sequential stepping"). `--fine` adds the boundaries inside a pass (the input
check, the ghost layers' exchange, the nested start, F-relaxation, the final reduction).
`--torch-part` times sequential stepping's step against torch's part of it (zero_grad,
the closing layer, the loss, autograd's backward pass, the update, with an autograd node
in the solves' place), in turns: what is left is mgrit's, at a rank's share of W2 (16
layers at 64 ranks) the cost the bound of docs/scaling.md ("Chosen settings at 64 ranks")
asks to cut.

Question: which costs of a rank's training step do not shrink with its layers, and which
does a 2-rank step add to sequential stepping's?
Answer: at 64 layers, the spans outside the forward cycles and the adjoint's solve (the
passes' set-up, the checks, the loss, autograd's start, gradient assembly, the update) are
313 of the step's 540 us. On 2 ranks the nested setting saves about 240 us of arithmetic a
rank and adds about 210 (the input check's agreement, the ghost layer, the nested starts'
rank-to-rank sweeps, the residuals and final reductions): parity with sequential stepping.
Results: docs/performance.md, "A step's fixed costs" and "Two ranks against sequential
stepping" (recorded there only).
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

from mgrit.comm.mpi import MPIComm
from mgrit.core import cycle
from mgrit.core.cycle import Solver
from mgrit.core.residual import DeferredHistory
from mgrit.nn import layer_parallel
from mgrit.nn.engine.ghosts import GhostExchange

from ..scaling.cases import setup, shared_model
from ..training import sequential_variant
from ..workloads import TRAINING_WORKLOADS, w2

# the solver's boundaries that split a step: (owner, method, label)
BOUNDARIES = ((Solver, "_solve", "solve"), (Solver, "_run_cycle", "cycle"),
              (Solver, "_local_residual", "residual"),
              (layer_parallel, "layer_gradients", "gradients"))
# with --fine, also the boundaries inside a pass
FINE = ((layer_parallel, "check_inputs", "check"), (GhostExchange, "refresh", "ghosts"),
        (Solver, "_nested", "nested"), (cycle, "f_relax", "F-relaxation"),
        (DeferredHistory, "finish", "reduction"))
# the setting `mgrit bench w2 --ranks 1,2` chose for W2 on 2 ranks (docs/results.md)
NESTED = dict(levels=2, coarsening=16, max_iter=0, initial_guess="nested", tol=0.0)


@contextlib.contextmanager
def _marked(marks: list[tuple[str, float]], boundaries: tuple = BOUNDARIES
            ) -> Iterator[None]:
    """Each boundary's entry and exit appended to `marks` (label, time) while entered."""
    saved = []
    for owner, name, label in boundaries:
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


def _workload(layers: int, sequential: bool, nested: bool) -> Any:
    """W2 with `layers` layers and the chosen setting (MGRIT's reference one by default)."""
    work = TRAINING_WORKLOADS["w2"]()
    if sequential:
        work = sequential_variant(work)
    elif nested:
        work = replace(work, forward=replace(work.forward, **NESTED),
                       backward=replace(work.backward, **NESTED))
    return replace(work, network=lambda: w2(num_steps=layers))


def measure(layers: int = 64, steps: int = 300, warmup: int = 50, sequential: bool = False,
            nested: bool = False, fine: bool = False, comm: Any = None) -> dict[str, Any]:
    """Medians (seconds) of the spans between consecutive marks of W2's training step with
    `layers` layers (MGRIT's reference setting, the nested setting, or sequential stepping)
    on the ranks of the mpi4py communicator `comm` (this process alone if None), over
    `steps` steps after `warmup`: this rank's, and on rank 0 of several every rank's in
    `ranks`."""
    if sequential and nested:
        raise ValueError("sequential and nested are two different settings: choose one")
    # one thread, as `mgrit bench` and the ranks of an MPI launch: torch would otherwise
    # spread the gradient assembly and the update over every core of the machine
    torch.set_num_threads(1)
    size = 1 if comm is None else comm.Get_size()
    work = _workload(layers, sequential, nested)
    net, built, x, y = setup(work)
    model = shared_model(work, net, built, None if size == 1 else MPIComm(comm))
    optimizer = work.optimizer(model.parameters())
    marks: list[tuple[str, float]] = []
    spans: dict[str, list[float]] = {}
    totals = []
    faults = 0
    with _marked(marks, BOUNDARIES + FINE if fine else BOUNDARIES):
        for k in range(warmup + steps):
            if size > 1:
                # every rank starts the step together: a span then holds this rank's own
                # waits, not the previous step's
                comm.Barrier()
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
    result = {"layers": layers, "steps": steps, "sequential": sequential, "nested": nested,
              "ranks": size, "torch": torch.__version__,
              "step": statistics.median(totals), "mean": statistics.mean(totals),
              "faults": faults / steps,
              "spans": {key: statistics.median(v) for key, v in spans.items()}}
    if size > 1:
        mine = {key: result[key] for key in ("step", "mean", "faults", "spans")}
        result["ranks_spans"] = comm.gather(mine, root=0)
    return result


class _HandOn(torch.autograd.Function):
    """Where the solves stand in the graph, without them: the state handed on, and for the
    layers' parameters gradients kept from the start (as autograd takes an assembled
    gradient, without a copy)."""

    @staticmethod
    def forward(ctx: Any, grads: list[torch.Tensor], u: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return u.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (None, grad, *ctx.grads)


def torch_part(layers: int = 16, steps: int = 100, rounds: int = 10) -> dict[str, Any]:
    """Seconds (fastest and median) of sequential stepping's training step of W2 with
    `layers` layers on one rank, one thread, and of torch's part of that step: zero_grad,
    an autograd node in the solves' place (`_HandOn`), the closing layer, the loss,
    autograd's backward pass and the optimizer's update of every parameter, on the same
    model and optimizer. The two take turns, `rounds` rounds of `steps` timed steps each
    after a few untimed; what is left of the step is mgrit's: the two solves, their set-up
    and the gradient assembly."""
    torch.set_num_threads(1)
    work = _workload(layers, sequential=True, nested=False)
    net, built, x, y = setup(work)
    model = shared_model(work, net, built, None)
    optimizer = work.optimizer(model.parameters())
    stacked = list(model.layers.parameters())
    grads = [torch.zeros_like(p) for p in stacked]
    u = model.opening(x).detach()

    def step() -> None:
        optimizer.zero_grad()
        work.loss(model(x), y).backward()
        optimizer.step()

    def torch_step() -> None:
        optimizer.zero_grad()
        work.loss(model.closing(_HandOn.apply(grads, u, *stacked)), y).backward()
        optimizer.step()

    parts = {"step": step, "torch": torch_step}
    times: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(rounds):
        for name, fn in parts.items():
            for _ in range(5):
                fn()
            for _ in range(steps):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    # the last step was torch's part: it updated what the real step updates
    every = all(p.grad is not None for p in model.parameters())
    out = {name: {"fastest": min(t), "median": statistics.median(t)}
           for name, t in times.items()}
    return {"layers": layers, "steps": steps, "rounds": rounds,
            "torch_version": torch.__version__, "torch_part_updates_every_parameter": every,
            **out, "mgrit": {k: out["step"][k] - out["torch"][k] for k in out["step"]}}


def torch_part_table(result: dict[str, Any]) -> str:
    """The split of `torch_part` in microseconds."""
    lines = ["| part of the step | fastest (us) | median (us) |", "| --- | ---: | ---: |"]
    for key, label in (("step", f"sequential stepping, {result['layers']} layers"),
                       ("torch", "torch's part (zero_grad, closing, loss, autograd, update)"),
                       ("mgrit", "mgrit's part (the difference)")):
        lines.append(f"| {label} | {result[key]['fastest'] * 1e6:.1f} | "
                     f"{result[key]['median'] * 1e6:.1f} |")
    return "\n".join(lines)


def table(result: dict[str, Any]) -> str:
    """The spans' medians in microseconds, a column per rank (one: this process's)."""
    columns = result.get("ranks_spans") or [result]
    head = " | ".join(f"rank {r} (us)" for r in range(len(columns)))
    lines = [f"| span | {head} |", "| --- |" + " ---: |" * len(columns)]
    for key in result["spans"]:
        # ranks mark alike (the same program on every rank); a span one lacks shows as -
        cells = " | ".join(f"{c['spans'][key] * 1e6:.1f}" if key in c["spans"] else "-"
                           for c in columns)
        lines.append(f"| {key[3:]} | {cells} |")
    lines.append("| whole step (median) | "
                 + " | ".join(f"{c['step'] * 1e6:.1f}" for c in columns) + " |")
    lines.append("| whole step (mean; page faults a step) | "
                 + " | ".join(f"{c['mean'] * 1e6:.1f} ({c['faults']:.1f})" for c in columns)
                 + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.fixed",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=64,
                        help="W2's layers, over all ranks (1024 / ranks on one rank)")
    parser.add_argument("--steps", type=int, default=300)
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--sequential", action="store_true",
                     help="sequential stepping (levels=1) instead of MGRIT's W2 setting")
    how.add_argument("--nested", action="store_true",
                     help="the setting chosen for W2 on 2 ranks: 2 levels, m = 16, no cycle "
                          "from nested starts")
    parser.add_argument("--fine", action="store_true",
                        help="also split each pass at its input check, ghost exchange, nested "
                             "start, F-relaxation and final reduction")
    how.add_argument("--torch-part", action="store_true",
                     help="sequential stepping's step against torch's part of it (one rank)")
    parser.add_argument("--json", help="also write the result here (rank 0)")
    args = parser.parse_args(argv)
    if args.torch_part:
        result = torch_part(args.layers, args.steps)
        print(f"W2's sequential step with {args.layers} layers on 1 rank, torch "
              f"{result['torch_version']}, {result['rounds']} rounds of {args.steps} steps\n")
        print(torch_part_table(result))
    else:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None
        result = measure(args.layers, args.steps, sequential=args.sequential,
                         nested=args.nested, fine=args.fine, comm=comm)
        if comm is not None and comm.Get_rank() != 0:
            return
        how = ("sequential stepping" if args.sequential else
               "the nested setting" if args.nested else "MGRIT's reference setting")
        print(f"W2 ({how}) with {args.layers} layers on {result['ranks']} rank(s), torch "
              f"{result['torch']}, median of {args.steps} steps\n")
        print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
