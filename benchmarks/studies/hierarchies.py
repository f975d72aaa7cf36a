"""W2's training step on P virtual ranks with other MGRIT hierarchies: levels, per-level
coarsening and relaxation (docs/performance.md, "Coarse levels"). Every variant runs in
this process, the variants alternated in rounds, and each keeps its fastest prediction on
the cluster network.

    python -m benchmarks.studies.hierarchies [--ranks 64] [--rounds 2] [--overhead S]

Question: does another MGRIT hierarchy (levels, coarsening, relaxation) shorten W2's
step at 64 ranks?
Answer: no step change: every variant came within -13% to +5% of the default but three
levels of m = 4 (slower); docs/performance.md, "Coarse levels". `levels` and `pathwork`
use its VARIANTS.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

from mgrit import Config
from mgrit.app.replay import Interconnect
from mgrit.nn.defaults import CYCLES

from ..scaling.cases import CURVES
from ..scaling.study import CLUSTER_BANDWIDTH, CLUSTER_LATENCY
from ..scaling.virtual import predict, work_traces
from ..workloads import TrainingWorkload

# name -> (levels, coarsening (one or per level), relaxation per level)
VARIANTS: dict[str, tuple[int, int | tuple[int, ...], tuple[str, ...]]] = {
    "4 levels, m = 4, F/FCF/FCF (default)": (4, 4, ("F", "FCF", "FCF")),
    "3 levels, m = 4, F/FCF": (3, 4, ("F", "FCF")),
    "5 levels, m = 4, F/FCF/FCF/FCF": (5, 4, ("F", "FCF", "FCF", "FCF")),
    "6 levels, m = 4, F, FCF below": (6, 4, ("F",) + ("FCF",) * 4),
    "5 levels, m = 4, F/FCF/F/F": (5, 4, ("F", "FCF", "F", "F")),
    "4 levels, m = 8, 4, 4, F/FCF/FCF": (4, (8, 4, 4), ("F", "FCF", "FCF")),
    "3 levels, m = 16, 4, F/FCF": (3, (16, 4), ("F", "FCF")),
}


def config(direction: str, levels: int, coarsening: int | tuple[int, ...],
           relax: tuple[str, ...]) -> Config:
    """A training solve's settings (fixed cycles, tol 0) with this hierarchy."""
    return Config(levels=levels, coarsening=coarsening, relax=relax,
                  max_iter=CYCLES[direction], tol=0.0, min_coarse=1)


def variant_work(name: str) -> TrainingWorkload:
    """W2's training step (the study's curve) with hierarchy `name` in both solves."""
    levels, coarsening, relax = VARIANTS[name]
    base = CURVES["w2"].work()
    return replace(base, forward=config("forward", levels, coarsening, relax),
                   backward=config("backward", levels, coarsening, relax))


@dataclass(frozen=True)
class HierarchyCase:
    """W2 with hierarchy `name`, as a case of the tools that take one (its name and its
    workload: `benchmarks.studies.hops --variant`)."""

    name: str

    def work(self, num_steps: int | None = None) -> TrainingWorkload:
        return variant_work(self.name)


def variant_point(name: str, ranks: int, network: Interconnect, repeats: int = 3,
                  warmup: int = 3) -> dict[str, Any]:
    """The prediction of W2's step with hierarchy `name` on `ranks` virtual ranks."""
    return predict(work_traces(variant_work(name), ranks, repeats, warmup), network)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.hierarchies",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--overhead", type=float, default=10.9e-6,
                        help="per-message posting overhead in seconds")
    args = parser.parse_args(argv)
    network = Interconnect(CLUSTER_LATENCY, CLUSTER_BANDWIDTH, args.overhead)
    best: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):
        for name in VARIANTS:
            point = variant_point(name, args.ranks, network)
            if name not in best or point["seconds"] < best[name]["seconds"]:
                best[name] = point
    print(f"W2 on {args.ranks} virtual ranks, fastest of {args.rounds} rounds")
    print("| levels, coarsening, relaxation | predicted step | hops | busy per rank |")
    print("|---|---|---|---|")
    for name, point in best.items():
        print(f"| {name} | {point['seconds'] * 1e3:.2f} ms | {point['critical']['hops']} | "
              f"{point['busy_mean'] * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
