"""Where the critical path of W2's training step on P virtual ranks goes, level by level
(docs/performance.md, "The path level by level"): for W2's hierarchy and the others of
`benchmarks.studies.hierarchies` (more or fewer levels, another coarsening), the path's
compute and its message hops split by pass (forward solve, adjoint solve, the rest of the
step) and multigrid level. A coarse level with fewer points than there are ranks is a
chain: its sweeps pass from rank to rank, one hop per point. The coarsest level's share is
what a coarse solve gathered onto one rank could at most save, less the hops of the gather
and the scatter.

Every message event of a timed virtual run (`virtual.work_traces`, fresh process; with
`--warm`, of its ranks run again alone, `benchmarks.studies.warm`) is labelled with the
level whose message it is and the pass it belongs to; a compute span on the path is
charged to the message that ends it (the last one, to the message before it), a hop to
the message or collective that carried the path to the next span. The predicted times use
the study's cluster network.

    python -m benchmarks.studies.levels [--ranks 64] [--variants 0,1,2] [--processes 3]
                                        [--warm] [--json PATH]

Question: which multigrid level holds the critical path's compute and hops?
Answer: the coarsest level is 0.28 of 2.94 ms (a gathered coarse solve could save at most
3%); each pass's set-up, collectives and the step's tail are the largest share (42%).
Result: docs/results/levels-64.json; docs/performance.md, "The path level by level".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any

from mgrit.app.replay import Event, Interconnect, replay
from mgrit.comm import tracing
from mgrit.core.boundary import Boundary

from ..scaling import virtual
from ..scaling.study import CLUSTER_BANDWIDTH, CLUSTER_LATENCY
from . import warm
from .hierarchies import VARIANTS, variant_work

# the CPU time of posting a persistent message on this machine (the study's ping-pong,
# docs/scaling.md, "Validation on 1 and 2 ranks")
OVERHEAD = 0.48e-6
NAMES = list(VARIANTS)      # the hierarchies, by number on the command line (0: W2's own)
PASSES = {"solve_forward": "forward", "solve_backward": "adjoint"}


def _label() -> tuple[str, int | None]:
    """(pass, level) of the message event being recorded, from the stack: the level whose
    messages send or wait, None for a collective or a message outside the levels."""
    level = None
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if level is None and isinstance(owner, Boundary):
            level = owner.level.index
        name = PASSES.get(frame.f_code.co_name)
        if name is not None:
            return name, level
        frame = frame.f_back
    return "step", level


Label = tuple[str, int | None]


def labelled_traces(variant: str, ranks: int, repeats: int, warmup: int, hot: bool = False
                    ) -> tuple[list[list[list[Event]]], list[list[list[Label | None]]]]:
    """Traces [repeat][rank] of W2's step with hierarchy `variant` (`hot`: of its ranks run
    again alone, `benchmarks.studies.warm`), and the label of each of their events (None
    for compute spans and marks), alike indexed (run in this process: `virtual.fresh` gives
    a clean one)."""
    by_id: dict[int, Label] = {}
    original = tracing.Tracer.record

    def record(self: tracing.Tracer, event: Event) -> None:
        if self.recording:
            by_id[id(event)] = _label()
        original(self, event)

    tracing.Tracer.record = record
    try:
        if hot:
            traces = warm.traces(variant_work(variant), ranks, repeats, warmup)[1]
        else:
            traces = virtual.work_traces(variant_work(variant), ranks, repeats, warmup)
    finally:
        tracing.Tracer.record = original
    labels = [[[by_id.get(id(e)) for e in events] for events in repeat] for repeat in traces]
    return traces, labels


def split(traces: list[list[Event]], labels: list[list[Label | None]],
          network: Interconnect) -> dict[str, Any]:
    """The predicted step of one repeat and its critical path's compute (seconds) and hops
    by "pass/level" ("pass/-" for the spans and hops of no level)."""
    pred = replay(traces, network, keep_path=True)
    compute: dict[str, float] = defaultdict(float)
    hops: dict[str, int] = defaultdict(int)

    def key(rank: int, i: int) -> str | None:
        label = labels[rank][i] if 0 <= i < len(labels[rank]) else None
        if label is None:
            return None
        return f"{label[0]}/{'-' if label[1] is None else label[1]}"

    path = pred.path
    for k, (rank, i) in enumerate(path):
        compute[key(rank, i + 1) or key(rank, i - 1) or "step/-"] += traces[rank][i][1]
        # the hops that carried the path here (the replay counts them), charged to the
        # message or collective that did
        hops_here = pred.path_hops[k] - (pred.path_hops[k - 1] if k else 0)
        if hops_here:
            event = _carrier(traces[rank], i, rank, path[k - 1][0] if k else None)
            hops[(key(rank, event) if event is not None else None) or "step/-"] += hops_here
    after = pred.critical["hops"] - (pred.path_hops[-1] if path else 0)
    if after:       # a collective after the path's last span
        rank, i = path[-1] if path else (0, -1)
        hops[key(rank, i + 1) or "step/-"] += after
    return {"seconds": pred.total, "critical": pred.critical, "compute": dict(compute),
            "hops": dict(hops)}


def _carrier(events: list[Event], i: int, rank: int, source: int | None) -> int | None:
    """The index of the event that carried the critical path to compute span i of a rank:
    a message from the rank the path came from, else a collective (the last of either
    between this span and the rank's span before it); None where there is none."""
    gap = []
    j = i - 1
    while j >= 0 and events[j][0] != "compute":
        gap.append(j)
        j -= 1
    if source is not None and source != rank:
        waits = [k for k in gap if events[k][0] == "wait" and events[k][1] == source]
        if waits:
            return waits[0]
    collectives = [k for k in gap if events[k][0] == "collective"]
    return collectives[0] if collectives else None


def measure(variant: str, ranks: int, repeats: int = 3, warmup: int = 3,
            overhead: float = OVERHEAD, processes: int = 1, hot: bool = False
            ) -> dict[str, Any]:
    """The split of the fastest of `repeats` traced steps, in each of `processes` fresh
    processes, of a variant on `ranks` virtual ranks (`hot`: warm ranks)."""
    network = Interconnect(CLUSTER_LATENCY, CLUSTER_BANDWIDTH, overhead)
    results = []
    for _ in range(processes):
        traces, labels = virtual.fresh(labelled_traces, variant, ranks, repeats, warmup, hot)
        results += [split(t, l, network) for t, l in zip(traces, labels)]
    best = min(results, key=lambda r: r["seconds"])
    best.update(variant=variant, ranks=ranks, latency=CLUSTER_LATENCY, overhead=overhead,
                warm=hot)
    return best


def _order(name: str) -> tuple[int, int]:
    phase, level = name.split("/")
    return (["step", "forward", "adjoint"].index(phase), -1 if level == "-" else int(level))


def table(results: list[dict[str, Any]]) -> str:
    """A markdown table per variant: the path's compute and hops by pass and level."""
    out = []
    for res in results:
        crit = res["critical"]
        out.append(f"**{res['variant']}**, {'warm' if res.get('warm') else 'virtual'} "
                   f"ranks, {res['ranks']} ranks: step {res['seconds'] * 1e3:.2f} ms, "
                   "path compute "
                   f"{crit['compute'] * 1e3:.2f} ms, communication "
                   f"{crit['communication'] * 1e3:.2f} ms, {crit['hops']} hops\n")
        out.append("| pass/level | compute on path (ms) | hops | hops x (latency + overhead) "
                   "(ms) |\n|---|---:|---:|---:|")
        names = sorted(set(res["compute"]) | set(res["hops"]), key=_order)
        per_hop = res["latency"] + res["overhead"]
        for name in names:
            n = res["hops"].get(name, 0)
            out.append(f"| {name} | {res['compute'].get(name, 0.0) * 1e3:.3f} | {n} | "
                       f"{n * per_hop * 1e3:.3f} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.levels",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--variants", default="0",
                        help="comma-separated numbers of the hierarchies: " +
                        "; ".join(f"{k}: {name}" for k, name in enumerate(NAMES)))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--processes", type=int, default=3,
                        help="fresh processes per variant, run in rounds (the fastest counts)")
    parser.add_argument("--overhead", type=float, default=OVERHEAD,
                        help="CPU seconds to post a message (default: this machine's)")
    parser.add_argument("--warm", action="store_true",
                        help="split the path of warm ranks (benchmarks.studies.warm)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    try:
        names = [NAMES[int(k)] for k in args.variants.split(",")]
    except (ValueError, IndexError):
        parser.error(f"--variants takes numbers from 0 to {len(NAMES) - 1}, got "
                     f"{args.variants!r}")
    # rounds over the variants, not each variant's processes in a row: the machine's slow
    # phases last minutes
    rounds = [[measure(n, args.ranks, args.repeats, args.warmup, args.overhead, hot=args.warm)
               for n in names] for _ in range(args.processes)]
    results = [min((r[k] for r in rounds), key=lambda r: r["seconds"])
               for k in range(len(names))]
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
