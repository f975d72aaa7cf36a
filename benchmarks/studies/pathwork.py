"""The work of a training step on P virtual ranks beside its predicted time: layer
evaluations on the critical path and on all ranks together, and the path's hops, each
over sequential stepping's (N forward + N adjoint evaluations, no hops).

The counts are `benchmarks.studies.hops`' counting run, matched event by event to the timed
run whose replay names the path; like its floor they count an adjoint step whose cotangent
is all zeros as no evaluation (no arithmetic is done for it), so a zero-started adjoint's
first sweep counts less than `benchmarks.work`'s steps asked of the propagator.

    python -m benchmarks.studies.pathwork [--ranks 1,2,16,64] [--variant N] [--json PATH]

Question: how much of sequential stepping's layer arithmetic lies on the critical path
of P ranks?
Answer: W2 does 3.34 times sequential's evaluations at every P; its critical path holds
1.66 times at 2 ranks, 0.21 at 16 and 0.069 at 64, while the predicted step stays at 2.2
to 3.5 ms: past a few ranks the path is hops and fixed costs, not arithmetic.
Results: docs/results/work-path-w2.json and work-path-w2-variants.json.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from mgrit.app.replay import Interconnect

from ..scaling.cases import CURVES
from ..scaling.study import CLUSTER_BANDWIDTH, CLUSTER_LATENCY
from . import hops


def path_work(result: dict[str, Any], num_steps: int) -> dict[str, Any]:
    """Evaluations (per N) on the critical path and on all ranks, and hops, of a
    `hops.measure` result."""
    out: dict[str, Any] = {"ranks": result["ranks"], "predicted": result["predicted"],
                           "hops": result["critical"]["hops"],
                           "floor": result["floor"]["predicted"]}
    for column, label in (("critical", "path"), ("busy", "all_ranks")):
        n = result["columns"][column]["counts"]
        fwd, adj = n["fwd_native"] + n["fwd_torch"], n["adj_native"] + n["adj_torch"]
        out[f"{label}_forward"], out[f"{label}_adjoint"] = fwd / num_steps, adj / num_steps
        out[f"{label}_total"] = (fwd + adj) / (2 * num_steps)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| ranks | predicted ms | floor ms | hops | path evals fwd / adj / total (x N) | "
             "all ranks fwd / adj / total (x N) |", "| ---: |" + " ---: |" * 5]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['predicted'] * 1e3:.3f} | {r['floor'] * 1e3:.3f} | "
            f"{r['hops']} | {r['path_forward']:.2f} / {r['path_adjoint']:.2f} / "
            f"{r['path_total']:.2f} | {r['all_ranks_forward']:.2f} / "
            f"{r['all_ranks_adjoint']:.2f} / {r['all_ranks_total']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,2,16,64", help="comma-separated rank counts")
    parser.add_argument("--variant", type=int, help="a W2 hierarchy of "
                        "benchmarks.studies.hierarchies (its number in VARIANTS)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    try:
        ranks = [int(p) for p in args.ranks.split(",")]
    except ValueError:
        raise SystemExit(f"--ranks must be comma-separated integers, got {args.ranks!r}")
    if not ranks or min(ranks) < 1 or args.repeats < 1:
        raise SystemExit("--ranks must list counts >= 1 and --repeats be >= 1")
    case: Any = CURVES["w2"]
    if args.variant is not None:
        from .hierarchies import VARIANTS, HierarchyCase

        case = HierarchyCase(list(VARIANTS)[args.variant])
    network = Interconnect(CLUSTER_LATENCY, CLUSTER_BANDWIDTH, hops.OVERHEAD)
    num_steps = case.work().network().num_steps
    rows = [path_work(hops.measure(case, p, repeats=args.repeats, network=network, rounds=50),
                      num_steps) for p in ranks]
    print(f"{case.name}: layer evaluations of one training step over sequential stepping's "
          "(N forward + N adjoint), on the critical path and on all ranks, cluster network")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"case": case.name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
