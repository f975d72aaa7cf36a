"""Two or more versions of mgrit timed side by side in one process, call by call.

    python -m benchmarks.ab REV [REV ...] [--workload w2] [--rounds 30] [--exact] [--serial]

Each REV (a git revision, or "." for the working tree) has its `mgrit` package exported
into a temporary folder under the name `mgrit_<n>` and imported next to the others; every
round times one training step (then, in rounds of their own, one forward pass) of the
workload's layer-parallel model on one rank for each version in turn, in the opposite order
every other round, so that a slow phase of a shared machine, and whatever running right
after another version costs, hits all of them alike. Prints each version's median and fastest time and its median as a ratio to the
first version's. `--exact` times exact passes (levels=1 both ways) in place of the
workload's MGRIT settings; `--serial` adds serial PyTorch (the plain network, first, so
that every ratio is to it) to the same rounds. What the commit message of a change to a hot path quotes when it says a
workload's speed is unchanged.

The library imports itself only relatively, which is what lets a version load under
another name; the workload is built from the public API every version has
(`LayerParallel`, `Config`) and `benchmarks.workloads`' network of this checkout.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from .timing import seconds
from .training import timed, timed_serial
from .workloads import TRAINING_WORKLOADS

ROOT = Path(__file__).resolve().parent.parent


def export(revision: str, folder: Path, name: str) -> None:
    """The `mgrit` package of `revision` ("." for the working tree) as folder/name."""
    target = folder / name
    if revision == ".":
        shutil.copytree(ROOT / "mgrit", target,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        return
    archive = folder / f"{name}.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), revision, "mgrit"],
                   check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder / f"{name}.src", filter="data")
    (folder / f"{name}.src" / "mgrit").rename(target)


def timed_steps(package: Any, workload: str, exact: bool = False
                ) -> tuple[Callable[[], None], Callable[[], None]]:
    """(one training step, one forward pass) of the workload's model built by `package`,
    with the workload's solver settings or (`exact`) exact passes."""
    work = TRAINING_WORKLOADS[workload]()
    torch.manual_seed(0)
    net = work.network()
    configs = [package.Config(levels=1, tol=0.0, max_iter=1) if exact
               else package.Config(**_options(c)) for c in (work.forward, work.backward)]
    steps = timed(work, package.LayerParallel(net.step, net.num_steps, net.t_final, *configs,
                                              opening=net.opening, closing=net.closing))
    return steps.step, steps.forward


def _options(config: Any) -> dict[str, Any]:
    """A Config's options as plain values that every version's Config takes."""
    return {k: v for k, v in config.describe().items() if k != "initial_guess"}


def serial_steps(workload: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """(one training step, one forward pass) of the workload's plain network."""
    serial = timed_serial(TRAINING_WORKLOADS[workload]())
    return serial.step, serial.forward


def compare(revisions: list[str], workload: str, rounds: int, exact: bool = False,
            serial: bool = False) -> list[dict[str, list]]:
    """Per version (in the order given; with `serial`, serial PyTorch first), per metric,
    the seconds of every round."""
    torch.set_num_threads(1)
    times: list[dict[str, list]] = [{} for _ in range(len(revisions) + serial)]
    with tempfile.TemporaryDirectory(prefix="mgrit-ab-") as tmp:
        sys.path.insert(0, tmp)
        try:
            steps = [serial_steps(workload)] if serial else []
            for n, revision in enumerate(revisions):
                name = f"mgrit_{n}"
                export(revision, Path(tmp), name)
                steps.append(timed_steps(importlib.import_module(name), workload, exact))
            order = list(range(len(steps)))
            for which, label in ((0, "train_step"), (1, "forward")):
                for n in order:                      # warm-up: storage, kernels
                    steps[n][which]()
                for k in range(rounds):
                    for n in (order if k % 2 == 0 else order[::-1]):
                        times[n].setdefault(label, []).append(seconds(steps[n][which]))
        finally:
            sys.path.remove(tmp)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("revisions", nargs="+", help='git revisions, "." for the working tree')
    parser.add_argument("--workload", default="w2", choices=sorted(TRAINING_WORKLOADS))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--exact", action="store_true",
                        help="exact passes (levels=1) in place of the workload's settings")
    parser.add_argument("--serial", action="store_true",
                        help="time serial PyTorch too, first")
    args = parser.parse_args(argv)
    times = compare(args.revisions, args.workload, args.rounds, args.exact, args.serial)
    names = ["serial"] * args.serial + args.revisions
    passes = "exact passes" if args.exact else "the workload's settings"
    print(f"{args.workload}, one rank, {passes}, {args.rounds} alternated rounds")
    print(f"{'revision':<12} {'metric':<11} {'median ms':>10} {'fastest ms':>11} "
          f"{'vs first':>9}")
    for revision, measured in zip(names, times):
        for label, runs in measured.items():
            base = statistics.median(times[0][label])
            print(f"{revision:<12} {label:<11} {statistics.median(runs) * 1e3:10.2f} "
                  f"{min(runs) * 1e3:11.2f} {statistics.median(runs) / base:9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
