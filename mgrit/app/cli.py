"""The `mgrit` command: train, compare, bench, demo.

    mgrit train [--config FILE] [flags]          (also under mpiexec -n P python -m mpi4py -m mgrit)
    mgrit compare [--config FILE] [flags] --ranks P
    mgrit bench WORKLOAD... [--ranks 1,2] [--json FILE]
    mgrit demo                                   the heat equation, parallel in time
    mgrit replay TRACE [--latency S] [--bandwidth B/s] [--overhead S]
                                                 predicted step times of a recorded trace
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from .. import __version__
from . import demo, environment
from .data import TEXTS, DataError
from .launch import LaunchError
from . import interrupts
from .settings import SettingsError, check, load, parse_override, resumed
from ..execute.host_memory import hold_freed_memory

# flag -> (section, key); each overrides the config file
SHORTCUTS = {
    "dataset": ("data", "name"), "network": ("network", "kind"), "width": ("network", "width"),
    "channels": ("network", "channels"), "steps": ("network", "steps"),
    "t_final": ("network", "t_final"), "epochs": ("training", "epochs"),
    "batch_size": ("training", "batch_size"), "optimizer": ("training", "optimizer"),
    "lr": ("training", "lr"), "seed": ("training", "seed"),
    "data_parallel": ("training", "data_parallel"), "out": ("output", "dir"),
    "trace": ("output", "trace"), "checkpoint_every": ("output", "checkpoint_every"),
    "device": ("training", "device"),
}
TYPES = {"width": int, "channels": int, "steps": int, "epochs": int, "batch_size": int,
         "seed": int, "data_parallel": int, "lr": float, "t_final": float, "trace": int,
         "checkpoint_every": int}
METAVARS = {"checkpoint_every": "STEPS"}


def _default(section: str, key: str) -> Any:
    from .settings import SECTIONS, SOLVER_DEFAULTS

    if section in SOLVER_DEFAULTS:
        return SOLVER_DEFAULTS[section][key]
    return getattr(SECTIONS[section](), key)


def add_training_arguments(parser: argparse.ArgumentParser, serial: bool = True) -> None:
    from .settings import CHOICES

    parser.add_argument("--config", metavar="FILE", help="settings file (TOML, YAML or JSON); "
                        "flags override it")
    parser.add_argument("--set", metavar="SECTION.KEY=VALUE", action="append", default=[],
                        help="override one setting, e.g. --set forward.max_iter=3 "
                             "(values are read as TOML); repeatable")
    for name in SHORTCUTS:
        section, key = SHORTCUTS[name]
        choices = CHOICES.get((section, key))
        metavar = None if choices else METAVARS.get(name, name.upper())
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=TYPES.get(name, str),
                            choices=choices, metavar=metavar,
                            help=f"[{section}] {key} (default: {_default(section, key)})")
    parser.add_argument("--levels", type=int, help="[forward] and [backward] levels, the "
                        "relaxation following them unless set (default: "
                        f"{_default('forward', 'levels')})")
    if serial:
        parser.add_argument("--serial", action="store_true", help="train the plain network "
                            "with autograd in one process (the baseline)")
    parser.add_argument("--overwrite", action="store_true", help="replace the results of "
                        "another run in the output directory (otherwise refused)")
    parser.add_argument("--no-progress", action="store_true", help="no progress display")
    parser.add_argument("--no-checkpoint", action="store_true", help="no checkpoints")
    parser.add_argument("--no-control", action="store_true", help="keep the solvers' cycles "
                        "and levels fixed: no probes of the gradients' error ([control] "
                        "enabled = false)")
    parser.add_argument("--choose", action="store_true", help="before the first step, "
                        "train with the solver options mgrit.nn.choose_settings picks on the "
                        "first batch within the threshold, timed against exact stepping "
                        "([control] choose = true)")
    parser.add_argument("--capture", action="store_true", help="every training step on "
                        "static buffers, captured as CUDA graphs on a GPU ([training] "
                        "capture = true)")
    parser.add_argument("--verbose", action="store_true", help="every rank logs its steps")


def settings_from(args: argparse.Namespace) -> Any:
    overrides = [parse_override(text) for text in args.set]
    for name, (section, key) in SHORTCUTS.items():
        value = getattr(args, name)
        if value is not None:
            overrides.append({section: {key: value}})
    if args.levels is not None:
        overrides.append({"forward": {"levels": args.levels},
                          "backward": {"levels": args.levels}})
    flags = {"serial": ("training", "serial", True), "no_progress": ("output", "progress", False),
             "no_checkpoint": ("output", "checkpoint", False),
             "no_control": ("control", "enabled", False),
             "choose": ("control", "choose", True),
             "capture": ("training", "capture", True),
             "verbose": ("output", "verbose", True), "overwrite": ("output", "overwrite", True)}
    for attr, (section, key, value) in flags.items():
        if getattr(args, attr, False):
            overrides.append({section: {key: value}})
    return load(args.config, overrides)


def _world() -> Any:
    from mpi4py import MPI

    return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None


def run_train(args: argparse.Namespace) -> int:
    import torch

    from .network import is_language_model
    from .train import Run

    torch.set_num_threads(1)
    settings = settings_from(args)
    if settings.output.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.resume:
        settings = resume_settings(settings, args.reset_optimizer)
    elif args.reset_optimizer:
        raise SettingsError("--reset-optimizer applies to --resume only")
    check(settings)
    world = _world()
    interrupts.install(world, settings, sys.argv)
    summary = Run(settings, world, resume=args.resume,
                  reset_optimizer=args.reset_optimizer).run()
    if (world is None or world.Get_rank() == 0) and summary:
        metrics = Path(settings.output.dir) / "metrics.jsonl"
        if is_language_model(settings):
            print(f"test loss {summary['test_loss']:.4f}, next-token accuracy "
                  f"{summary['test_accuracy'] * 100:.2f}% after epoch {summary['epoch']}; "
                  f"metrics in {metrics}")
        else:
            print(f"test accuracy {summary['test_accuracy'] * 100:.2f}% after epoch "
                  f"{summary['epoch']}; metrics in {metrics}")
    return 0


def resume_settings(given: Any, reset_optimizer: bool) -> Any:
    """The settings of `--resume`: the checkpoint's, with what the command line changed
    where a resume may change it (`settings.resumed`)."""
    import json

    out = Path(given.output.dir)
    latest = out / "latest"
    if not latest.exists():
        raise SettingsError(f"--resume: no checkpoint in {out} (no 'latest' file)")
    meta_path = out / latest.read_text().strip() / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise SettingsError(f"--resume: {meta_path} cannot be read ({err})") from None
    if "settings" not in meta:
        # written by an earlier mgrit, which kept only what had to match
        return given
    return resumed(meta["settings"], given, reset_optimizer)


def run_compare(args: argparse.Namespace) -> int:
    import torch

    from . import compare

    torch.set_num_threads(1)
    if args.ranks < 1:
        raise SettingsError(f"--ranks {args.ranks}: the layer-parallel run needs at least 1 "
                            "rank")
    if args.deep_steps is not None and args.deep_steps < 2:
        raise SettingsError(f"--deep-steps {args.deep_steps}: the deep network needs at least "
                            "2 layers")
    settings = check(settings_from(args))
    if args.deep_steps and settings.data.name in TEXTS:
        raise SettingsError(f"--deep-steps times a deep dense network, which does not take "
                            f"the text of {settings.data.name}: leave it out, or compare on "
                            "feature or image data")
    out = Path(settings.output.dir)
    compare.compare_training(settings, out, args.ranks)
    if args.deep_steps:
        compare.deep_speed(settings, out, args.ranks, args.deep_steps)
    if args.solver_study:
        network = out / "serial" / "model.pt"
        from .data import load as load_data

        split = load_data(settings.data.name, settings.data.root, settings.data.download,
                          settings.data.test_fraction, settings.data.samples,
                          context=settings.data.context)
        compare.solver_study(out, network=network, sample=split.x_test[:64])
    return 0


def run_replay(args: argparse.Namespace) -> int:
    from .replay import Interconnect, load_traces, replay, step_spans

    traces, meta = load_traces(args.trace)
    network = Interconnect(args.latency, args.bandwidth, args.overhead)
    pred = replay(traces, network)
    spans = step_spans(pred)
    measured = meta.get("step_seconds", [])
    print(f"{args.trace}: {len(traces)} ranks, {len(spans)} traced training steps; network "
          f"latency {network.latency:.2e} s, bandwidth {network.bandwidth:.2e} B/s, "
          f"overhead {network.overhead:.2e} s per message")
    print(f"{'step':>5} {'predicted':>10} {'measured':>10}")
    for k, seconds in enumerate(spans):
        m = f"{measured[k] * 1e3:8.2f}ms" if k < len(measured) else f"{'-':>10}"
        print(f"{k + 1:>5} {seconds * 1e3:8.2f}ms {m}")
    crit = pred.critical
    print(f"over all traced steps: {pred.total * 1e3:.2f} ms; compute per rank mean "
          f"{sum(pred.busy) / len(pred.busy) * 1e3:.2f} ms, max {max(pred.busy) * 1e3:.2f} ms; "
          f"critical path {crit['compute'] * 1e3:.2f} ms compute, "
          f"{crit['communication'] * 1e3:.2f} ms communication, {crit['hops']} message hops")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    """`mgrit bench ...` is the benchmarks' own command line (`python -m benchmarks.bench`),
    which ships with a source checkout of mgrit rather than with the library."""
    try:
        from benchmarks import bench
    except ModuleNotFoundError as err:
        if err.name != "benchmarks":
            raise
        raise ImportError("mgrit bench runs the benchmarks of a source checkout of mgrit "
                          "(pip install -e . in the repository)") from None
    return bench.main(args.arguments)


def build_parser() -> argparse.ArgumentParser:
    """The `mgrit` command's parser (also read by the test that the docs' commands parse)."""
    parser = argparse.ArgumentParser(prog="mgrit", description="Multigrid reduction in time "
                                     "for time stepping and layer-parallel ResNet training.")
    parser.add_argument("--version", action="version", version=f"mgrit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a ResNet (layer-parallel under mpiexec)")
    add_training_arguments(train)
    train.add_argument("--resume", action="store_true", help="continue from the latest "
                       "checkpoint in the output directory, with its settings; flags may "
                       "change the epochs, learning rate, momentum, weight decay, output and "
                       "solver cycles (docs/user-guide.md)")
    train.add_argument("--reset-optimizer", action="store_true", help="with --resume: a fresh "
                       "optimizer (its kind may then change) instead of the checkpoint's state")
    cmp = sub.add_parser("compare", help="serial against layer-parallel training: figures, "
                         "table, JSON")
    add_training_arguments(cmp, serial=False)
    cmp.add_argument("--ranks", type=int, default=2, help="ranks of the layer-parallel run "
                     "(default: 2)")
    cmp.add_argument("--solver-study", action="store_true", help="also study the solver's "
                     "convergence on Dahlquist, heat and the trained network's layers")
    cmp.add_argument("--deep-steps", type=int, metavar="N", help="then time one epoch of a "
                     "deep narrow network of N layers both ways (make demo: 1024)")
    bench = sub.add_parser("bench", help="run benchmark workloads (the repository's "
                           "research tools, `benchmarks/`)", add_help=False)
    bench.add_argument("arguments", nargs=argparse.REMAINDER)
    demo.add_arguments(sub.add_parser("demo", help="parallel-in-time heat equation solve"))
    environment.add_arguments(sub.add_parser(
        "env", help="what mgrit finds here: versions, GPUs, MPI, whether its kernels build"))
    rep = sub.add_parser("replay", help="replay a trace recorded by `mgrit train --trace K` "
                         "on a modelled network: predicted time per step")
    rep.add_argument("trace", help="trace file (OUT/trace.json)")
    rep.add_argument("--latency", type=float, default=5e-6, help="seconds per message hop "
                     "(default 5e-6, an InfiniBand-class cluster)")
    rep.add_argument("--bandwidth", type=float, default=1e10, help="bytes per second "
                     "(default 1e10)")
    rep.add_argument("--overhead", type=float, default=1e-6, help="sender's seconds per "
                     "message (default 1e-6)")
    return parser


def main(argv: list[str] | None = None) -> int:
    # before the first tensor: steps keep their blocks instead of mapping them afresh, in
    # this process and the ranks it launches (mgrit.execute.host_memory)
    hold_freed_memory()
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        # argparse hands a leading flag such as --help to the top parser, not to the
        # remainder: `mgrit bench --help` would fail; the benchmarks' own parser reads it all
        args = argparse.Namespace(command="bench", arguments=argv[1:])
    else:
        args = parser.parse_args(argv)
    handlers = {"train": run_train, "compare": run_compare, "bench": run_bench,
                "demo": demo.run, "replay": run_replay, "env": environment.run}
    try:
        return handlers[args.command](args)
    except (SettingsError, DataError) as err:
        # raised alike on every rank (settings and data are read by each, and checkpoint
        # errors are agreed on by all ranks): said once, every rank ends
        if _rank() == 0:
            sys.stderr.write(f"mgrit {args.command}: error: {err}\n")
        return _ended_together(2)
    except (LaunchError, OSError, ValueError, TypeError, ImportError, RuntimeError) as err:
        return _failed(args.command, err)
    except KeyboardInterrupt:
        return interrupts.stopped(args.command)


def _ended_together(code: int) -> int:
    """Every rank ends with `code` after an error they all raised. Under `python -m mpi4py`
    a non-zero exit would make each rank call MPI_Abort and MPICH print a line per rank;
    since all ranks know, they finalize MPI and leave together instead."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or mpi.COMM_WORLD.Get_size() == 1 or mpi.Is_finalized():
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    mpi.Finalize()
    os._exit(code)


# where MPI launchers put a process's rank: an error raised before MPI is initialized is
# said by rank 0 alone too
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def _rank() -> int:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_rank()
    for name in RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _failed(command: str, err: BaseException) -> int:
    """An error on this rank alone: its message, with its rank under MPI, and then the end
    of every rank (the others may be waiting for this one's messages)."""
    mpi = sys.modules.get("mpi4py.MPI")
    size = mpi.COMM_WORLD.Get_size() if mpi is not None else 1
    where = f" on rank {mpi.COMM_WORLD.Get_rank()} of {size}" if size > 1 else ""
    sys.stderr.write(f"mgrit {command}: error{where}: {err}\n")
    sys.stderr.flush()
    if size > 1:
        mpi.COMM_WORLD.Abort(2)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
