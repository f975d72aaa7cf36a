"""`make bench-check`: the speed ratios that guard the hot paths, against recorded floors.

    python -m benchmarks.check [--json FILE] [--rounds R]

One process, one thread, well under a minute. Every guarded figure is a speedup, a
baseline's time over mgrit's, measured in one run with the two sides alternated round by
round and each side's fastest round kept, so a slow phase of a shared machine hits both:

  w0 solve vs sequential         W0's MGRIT solve against stepping its propagator in a loop
  w2 forward vs serial pytorch   W2's one-rank forward pass (no gradients, training mode)
  w2 train vs serial pytorch     W2's one-rank training step, against the plain network
  w2 forward vs sequential       the same against sequential stepping with mgrit's own
  w2 train vs sequential         kernels (LayerParallel with levels=1): the algorithm's gain
                                 apart from the kernels'

Each is compared with its floor in benchmarks/floors.json. A figure below its floor is
measured once more (the machine has slow phases); if it is still below, the check exits
with status 1 and names the figure with both numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .timing import seconds

FLOORS = Path(__file__).with_name("floors.json")


@dataclass
class Pair:
    """A guarded speedup: `baseline` time over `mgrit` time (each a callable of one run)."""

    name: str
    baseline: Callable[[], object]
    mgrit: Callable[[], object]


def speedup(pair: Pair, rounds: int) -> dict[str, float]:
    """Alternated rounds after one warm-up run of each side; the fastest of each side."""
    pair.baseline()
    pair.mgrit()
    base, ours = [], []
    for _ in range(rounds):
        base.append(seconds(pair.baseline))
        ours.append(seconds(pair.mgrit))
    return {"baseline_seconds": min(base), "mgrit_seconds": min(ours),
            "speedup": min(base) / min(ours)}


def w0_pairs() -> list[Pair]:
    from .workloads import w0_workload

    work = w0_workload()
    return [Pair("w0 solve vs sequential", work.sequential, work.solve)]


def w2_pairs() -> list[Pair]:
    from .training import build, forward_fn, parallel_model, sequential_variant, train_step_fn
    from .workloads import TRAINING_WORKLOADS

    work = TRAINING_WORKLOADS["w2"]()
    x, y = work.inputs(torch.Generator().manual_seed(1))
    model, serial = build(work)
    stepped = parallel_model(sequential_variant(work))
    return [Pair("w2 forward vs serial pytorch", forward_fn(serial, x), forward_fn(model, x)),
            Pair("w2 train vs serial pytorch", train_step_fn(serial, work, x, y),
                 train_step_fn(model, work, x, y)),
            Pair("w2 forward vs sequential", forward_fn(stepped, x), forward_fn(model, x)),
            Pair("w2 train vs sequential", train_step_fn(stepped, work, x, y),
                 train_step_fn(model, work, x, y))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--rounds", type=int, default=11, help="alternated rounds per figure")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    floors = {k: v for k, v in json.loads(FLOORS.read_text()).items() if not k.startswith("_")}
    start = time.perf_counter()
    results = {}
    # W0 first, before W2's 1024-layer models fill the heap: every collection of Python's
    # garbage collector during W0's solve would otherwise scan them too
    for group in (w0_pairs, w2_pairs):
        for pair in group():
            if pair.name not in floors:
                print(f"benchmarks/floors.json has no floor for {pair.name!r}", file=sys.stderr)
                return 2
            results[pair.name] = speedup(pair, args.rounds)
            if results[pair.name]["speedup"] < floors[pair.name]:
                print(f"below the floor: {pair.name}; measuring it again")
                results[pair.name] = speedup(pair, args.rounds)
    missing = sorted(set(floors) - set(results))
    if missing:
        print(f"benchmarks/floors.json has floors for figures the check does not measure: "
              f"{missing}", file=sys.stderr)
        return 2
    print(f"{'figure':<30} {'baseline ms':>11} {'mgrit ms':>9} {'speedup':>8} {'floor':>6}")
    failed = []
    for name, r in results.items():
        ok = r["speedup"] >= floors[name]
        failed += [] if ok else [name]
        print(f"{name:<30} {r['baseline_seconds'] * 1e3:11.2f} {r['mgrit_seconds'] * 1e3:9.2f} "
              f"{r['speedup']:8.2f} {floors[name]:6.2f}{'' if ok else '  BELOW'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"floors": floors, "results": results}, indent=2))
    seconds = time.perf_counter() - start
    if failed:
        for name in failed:
            print(f"bench-check: {name} fell to {results[name]['speedup']:.2f}x, below its floor "
                  f"of {floors[name]:.2f}x (measured twice)", file=sys.stderr)
        return 1
    print(f"bench-check passed: {len(results)} figures at or above their floors "
          f"({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
