"""The keyed dropout's keep masks hashed by torch's int64 operations or by mgrit's C loop.

    python -m benchmarks.masks [--rounds 12] [--json FILE]

First one mask of a W4 block's size (batch 16, 64 tokens, width 64), each way; then W4's
training step with either (`MGRIT_NATIVE=torch` switches the masks to torch's operations
and, for transformer blocks, nothing else), with exact passes and with the workload's MGRIT
settings, next to serial PyTorch (torch's own dropout) in the same alternated rounds, one
process, one thread. Keys change every training step, so every step hashes its masks anew.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Callable

import torch

import mgrit
from mgrit.nn.engine import randomness

from .ab import serial_steps, timed_steps
from .timing import seconds

SHAPE = (16, 64, 64)
# the environment's kernels choice in each column: where the masks are hashed
MASKS = {"torch masks": "torch", "C masks": "auto"}


def one_mask(rounds: int) -> dict[str, float]:
    """Fastest seconds of one mask of SHAPE each way (a new key every call)."""
    best = {name: float("inf") for name in MASKS}
    threshold = int(0.1 * 2**32)
    for k in range(rounds * 4):
        for name, choice in MASKS.items():
            os.environ["MGRIT_NATIVE"] = choice
            best[name] = min(best[name], seconds(
                lambda: randomness._keep(1000 + k, 0, SHAPE, torch.device("cpu"), threshold)))
    return best


def training_steps(rounds: int, exact: bool) -> dict[str, list[float]]:
    """Seconds of W4 training steps per column, alternated round by round."""
    columns: dict[str, tuple[Callable[[], None], str | None]] = {
        "serial pytorch": (serial_steps("w4")[0], None)}
    step = timed_steps(mgrit, "w4", exact=exact)[0]
    columns.update({name: (step, choice) for name, choice in MASKS.items()})
    names = list(columns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for k in range(rounds + 1):                     # the first round warms up
        for name in (names if k % 2 else names[::-1]):
            fn, choice = columns[name]
            if choice is not None:
                os.environ["MGRIT_NATIVE"] = choice
            elapsed = seconds(fn)
            if k:
                times[name].append(elapsed)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.masks", description=__doc__)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--json", help="write the times here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    saved = os.environ.get("MGRIT_NATIVE")
    try:
        mask = one_mask(args.rounds)
        print(f"one keep mask of {SHAPE}: " + ", ".join(
            f"{name} {s * 1e6:.0f} us" for name, s in mask.items()))
        record = {"mask_shape": list(SHAPE), "mask_seconds": mask, "steps": {}}
        for exact in (True, False):
            times = training_steps(args.rounds, exact)
            label = "exact passes" if exact else "the workload's MGRIT settings"
            base = statistics.median(times["serial pytorch"])
            print(f"\nW4 training step, {label}, {args.rounds} alternated rounds")
            print(f"{'column':16s} {'median ms':>10s} {'fastest ms':>11s} {'vs serial':>10s}")
            for name, values in times.items():
                median = statistics.median(values)
                print(f"{name:16s} {median * 1e3:10.1f} {min(values) * 1e3:11.1f} "
                      f"{median / base:10.3f}")
            record["steps"]["exact" if exact else "mgrit"] = times
    finally:
        if saved is None:
            os.environ.pop("MGRIT_NATIVE", None)
        else:
            os.environ["MGRIT_NATIVE"] = saved
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
