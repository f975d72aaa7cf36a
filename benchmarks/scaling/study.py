"""The scaling study: predicted speedups of layer-parallel training past this machine
(docs/design.md, section 7; docs/scaling.md), written to OUT_DIR/scaling.json and
OUT_DIR/figures/scaling.png, with its tables printed; with `--cases`, the named transformer
cases alone (`TRANSFORMER_CURVES`), written to OUT_DIR/scaling-CASES.json and
OUT_DIR/figures/scaling-CASES.png."""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mgrit.app.replay import Interconnect, replay

from ..work import ratios, step_work
from .cases import (CHECKS, CURVES, SERIAL_DEPTHS, TRANSFORMER_CURVES, ScalingCase,
                    torch_kernels)
from .serial import fastest_serial, layerwise_traces, serial_costs, serial_seconds
from .validation import VALIDATED, network_from, validation
from .virtual import fastest_points, fresh

log = logging.getLogger(__name__)

RANKS = [2 ** k for k in range(1, 11)]
# An assumed cluster interconnect (InfiniBand-class MPI: a few microseconds, ~10 GB/s); the
# per-message CPU overhead is this implementation's, measured on this machine.
CLUSTER_LATENCY, CLUSTER_BANDWIDTH = 5e-6, 10e9
LITERATURE_SPEEDUP = 10.2   # Kirby et al. 2020, over layer-wise model parallelism, GPUs


def curve(case: ScalingCase, ranks: list[int], networks: dict[str, Interconnect]
          ) -> list[dict[str, Any]]:
    """Predicted MGRIT times of one case per rank count and network (`add_baselines`
    completes the rows)."""
    def done(case: ScalingCase | None, p: int, point: dict[str, Any], seconds: float) -> None:
        last = list(point["predictions"].values())[-1]      # of the last network given
        log.info("%s, %d ranks: %.2f ms per training step (%.0f s)", case.name, p,
                 last["seconds"] * 1e3, seconds)

    rows = []
    for p, point in zip(ranks, fastest_points([(case, p) for p in ranks], networks, done)):
        for label in networks:
            pred = point["predictions"][label]
            rows.append({"case": case.name, "network": label, "ranks": p,
                         "num_steps": case.num_steps, "mgrit_train": pred["seconds"],
                         "mgrit_forward": pred["forward_seconds"],
                         "busy_mean": pred["busy_mean"], "critical": pred["critical"],
                         "kernels": point["kernels"]})
    return rows


def add_baselines(rows: list[dict[str, Any]], serial: dict[str, Any],
                  networks: dict[str, Interconnect]) -> None:
    """Serial and layer-wise model-parallel times, and the speedups, into curve rows."""
    for row in rows:
        n, p, network = row["num_steps"], row["ranks"], networks[row["network"]]
        serial_train = serial_seconds(serial, n, ("forward", "backward", "update"))
        serial_forward = serial_seconds(serial, n, ("inference",))
        mp_train = replay(layerwise_traces(serial, n, p, train=True), network).total
        mp_forward = replay(layerwise_traces(serial, n, p, train=False), network).total
        row.update({
            "serial_train": serial_train, "serial_forward": serial_forward,
            "layerwise_train": mp_train, "layerwise_forward": mp_forward,
            "speedup_vs_serial": serial_train / row["mgrit_train"],
            "speedup_vs_layerwise": mp_train / row["mgrit_train"],
            "forward_speedup_vs_serial": serial_forward / row["mgrit_forward"],
            "forward_speedup_vs_layerwise": mp_forward / row["mgrit_forward"]})


def _serial_for(name: str, serial: dict[str, Any]) -> dict[str, Any]:
    """The serial costs of a curve's case, or of the case a variant was made from."""
    return serial[name] if name in serial else serial[next(n for n in serial
                                                           if name.startswith(n))]


def study(ranks: list[int] | None = None, variant_ranks: tuple[int, ...] = (64, 256)
          ) -> dict[str, Any]:
    """Everything docs/scaling.md reports: validation on 1 and 2 MPI ranks, the measured
    network, serial costs, the predicted curves (W1 from 2 ranks: one rank would hold all
    1024 conv layers' states) and hierarchy-depth variants of W2. Every method computes
    with torch's kernels, no native convolutions or dense steps (the virtual ranks charge
    W1's convolutions from measurements of torch's), so that the ratios compare methods,
    not kernels."""
    with torch_kernels():
        result = _study(ranks, variant_ranks)
    cluster = Interconnect(**result["networks"]["cluster"])
    result["native"] = native_curve([1, *RANKS] if ranks is None else ranks, cluster,
                                    result["serial_costs"]["w2"])
    return result


def native_curve(ranks: list[int], cluster: Interconnect, serial: dict[str, Any]
                 ) -> list[dict[str, Any]]:
    """W2 once more on mgrit's own kernels (MGRIT_NATIVE as the environment has it, by
    default the native C dense steps with compiled and recorded phases): what a user of
    the package runs, beside the torch-kernel curve that compares methods alone. Its
    baselines are the same serial PyTorch and layer-wise model parallelism (torch's
    kernels), and mgrit's own sequential march (levels=1) on one rank with these kernels,
    the fastest way this package has to run W2 on one core."""
    case = replace(CURVES["w2"], name="w2-native")
    rows = curve(case, case.usable(ranks), {"cluster": cluster})
    add_baselines(rows, serial, {"cluster": cluster})
    march_case = replace(CURVES["w2"], name="w2-native-sequential", levels=1)
    march = fastest_points([(march_case, 1)], {"cluster": cluster})[0]
    seconds = march["predictions"]["cluster"]["seconds"]
    one_rank = next((r["mgrit_train"] for r in rows if r["ranks"] == 1), None)
    for row in rows:
        row.update({"kernels_backend": os.environ.get("MGRIT_NATIVE", "auto"),
                    "sequential_march_train": seconds,
                    "speedup_vs_sequential_march": seconds / row["mgrit_train"],
                    "speedup_vs_one_rank": (one_rank / row["mgrit_train"]
                                            if one_rank is not None else None)})
    return rows


def _study(ranks: list[int] | None, variant_ranks: tuple[int, ...]) -> dict[str, Any]:
    torch.set_num_threads(1)
    ranks = [1, *RANKS] if ranks is None else ranks
    ping, validation_rows = validation()
    shared = network_from(ping)
    cluster = Interconnect(CLUSTER_LATENCY, CLUSTER_BANDWIDTH, shared.overhead)
    networks = {"cluster": cluster, "shared memory": shared}
    serial, serial_runs, curves = _curves(CURVES, ranks, networks)
    variants = []
    for levels in [n for n in (3, 4, 5) if n != CURVES["w2"].work().forward.levels]:
        case = replace(CURVES["w2"], name=f"w2-levels{levels}", levels=levels)
        variants += curve(case, list(variant_ranks), {"cluster": cluster})
    for row in variants:
        add_baselines([row], _serial_for(row["case"], serial), networks)
    checks = {n: CHECKS[n] for n in VALIDATED if n in CHECKS}
    return _result(CURVES, checks, networks, ping, validation_rows, serial, serial_runs,
                   curves, variants)


def _curves(cases: dict[str, ScalingCase], ranks: list[int], networks: dict[str, Interconnect]
            ) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    """The predicted curves of `cases` on the rank counts each can use, with the serial and
    layer-wise baselines: (serial costs, all serial cost runs, curve rows)."""
    serial_runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}

    def measure_serial() -> None:
        # serial costs are measured between the curves, so that no slow phase of the
        # machine sets them; the fastest run counts
        log.info("serial PyTorch costs")
        for name, case in cases.items():
            serial_runs[name].append(fresh(serial_costs, case, SERIAL_DEPTHS[name]))

    measure_serial()
    curves = []
    for case in cases.values():
        curves += curve(case, case.usable(ranks), networks)
        measure_serial()
    serial = {name: fastest_serial(runs, cases[name].num_steps)
              for name, runs in serial_runs.items()}
    for row in curves:
        add_baselines([row], serial[row["case"]], networks)
    return serial, serial_runs, curves


def _result(curve_cases: dict[str, ScalingCase], checks: dict[str, ScalingCase],
            networks: dict[str, Interconnect], ping: dict[str, float],
            validation_rows: list[dict[str, Any]], serial: dict[str, Any],
            serial_runs: dict[str, list[dict[str, Any]]], curves: list[dict[str, Any]],
            variants: list[dict[str, Any]]) -> dict[str, Any]:
    cases = {c.name: {"workload": c.workload, "num_steps": c.num_steps, "costed": c.costed,
                      "repeats": c.repeats, "processes": c.processes,
                      "description": c.work().description,
                      "forward": c.work().forward.describe(),
                      "backward": c.work().backward.describe(),
                      # layer evaluations of a step over sequential stepping's, all ranks
                      "evaluations": ratios(step_work(c.work()))}
             for c in (*curve_cases.values(), *checks.values())}
    return {"cases": cases, "networks": {k: vars(v) for k, v in networks.items()},
            "ping_pong": ping, "validation": validation_rows, "serial_costs": serial,
            "serial_runs": serial_runs,
            "curves": curves, "variants": variants,
            "literature_speedup_vs_layerwise": LITERATURE_SPEEDUP, "convolutions": "torch",
            "torch": torch.__version__, "cpus": os.cpu_count()}


def transformer_study(names: list[str], ranks: list[int] | None = None) -> dict[str, Any]:
    """The curves of the TRANSFORMER_CURVES cases `names`, after the validation of those
    that are CHECKS on 1 and 2 MPI ranks (which also measures the network), as `study`
    computes W1's and W2's."""
    with torch_kernels():
        torch.set_num_threads(1)
        checked = tuple(n for n in names if n in CHECKS)
        # a W4 run at 1024 layers alone is still checked on W4's own 32 layers
        checked = checked or tuple(n for n in CHECKS if any(m.startswith(n) for m in names))
        ping, validation_rows = validation(checked)
        shared = network_from(ping)
        networks = {"cluster": Interconnect(CLUSTER_LATENCY, CLUSTER_BANDWIDTH,
                                            shared.overhead),
                    "shared memory": shared}
        cases = {n: TRANSFORMER_CURVES[n] for n in names}
        serial, serial_runs, curves = _curves(cases, [1, *RANKS] if ranks is None else ranks,
                                              networks)
        return _result(cases, {n: CHECKS[n] for n in checked}, networks, ping,
                       validation_rows, serial, serial_runs, curves, [])


def plot(result: dict[str, Any], path: Path) -> None:
    """Predicted speedups of a training step against P, one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["case"] for r in result["curves"]))
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4.2), sharey=True,
                             squeeze=False)
    axes = axes[0]
    for ax, name in zip(axes, names):
        for network, style in (("cluster", "-"), ("shared memory", ":")):
            rows = [r for r in result["curves"] if r["case"] == name and r["network"] == network]
            p = [r["ranks"] for r in rows]
            ax.plot(p, [r["speedup_vs_layerwise"] for r in rows], style, marker="o", ms=3,
                    color="C0", label=f"vs layer-wise model parallel ({network})")
            ax.plot(p, [r["speedup_vs_serial"] for r in rows], style, marker="s", ms=3,
                    color="C1", label=f"vs serial PyTorch ({network})")
        ax.axhline(LITERATURE_SPEEDUP, color="C3", lw=1, ls="--",
                   label="10.2x reported over layer-wise MP (GPUs)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks P (one core each)")
        ax.set_title(f"{name.upper()}: predicted training-step speedup")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("speedup")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_tables(result: dict[str, Any]) -> None:
    print("validation (seconds; error = predicted / measured - 1)")
    print(f"{'case':>6} {'metric':>8} {'P':>2} {'measured':>9} {'from MPI traces':>15} "
          f"{'error':>7} {'virtual ranks':>13} {'error':>7}")
    for r in result["validation"]:
        print(f"{r['case']:>6} {r['metric']:>8} {r['ranks']:>2} {r['measured']:9.4f} "
              f"{r['predicted_from_mpi_traces']:15.4f} {r['error']:+7.1%} "
              f"{r['predicted_virtual']:13.4f} {r['virtual_error']:+7.1%}")
    names = list(dict.fromkeys(r["case"] for r in result["curves"]))
    for name in (*names, *(["variants"] if result["variants"] else [])):
        rows = ([r for r in result["curves"] if r["case"] == name and r["network"] == "cluster"]
                if name != "variants" else result["variants"])
        print(f"\n{name}: predicted, cluster network (ms; speedups of a training step / of "
              "a forward pass; hops on the critical path; evals: a step's layer evaluations "
              "over sequential stepping's, all ranks)")
        print(f"{'case':>10} {'P':>5} {'MGRIT':>9} {'layer-wise':>10} {'serial':>9} "
              f"{'vs layer-wise':>13} {'vs serial':>9} {'fwd vs lw':>9} {'fwd vs serial':>13} "
              f"{'hops':>5} {'evals':>5}")
        for r in rows:
            evals = result["cases"].get(r["case"], {}).get("evaluations")
            print(f"{r['case']:>10} {r['ranks']:>5} {r['mgrit_train'] * 1e3:9.2f} "
                  f"{r['layerwise_train'] * 1e3:10.2f} {r['serial_train'] * 1e3:9.2f} "
                  f"{r['speedup_vs_layerwise']:13.2f} {r['speedup_vs_serial']:9.2f} "
                  f"{r['forward_speedup_vs_layerwise']:9.2f} "
                  f"{r['forward_speedup_vs_serial']:13.2f} {r['critical'].get('hops', '-'):>5} "
                  f"{'-' if evals is None else format(evals['train_total'], '5.2f'):>5}")
    native = result.get("native") or []
    if native:
        print(f"\nw2 on mgrit's default kernels (MGRIT_NATIVE={native[0]['kernels_backend']}): "
              "predicted training step, cluster network (ms; speedups); mgrit's sequential "
              f"march on one rank: {native[0]['sequential_march_train'] * 1e3:.2f} ms")
        print(f"{'P':>5} {'MGRIT':>9} {'vs 1 rank':>9} {'vs layer-wise':>13} "
              f"{'vs serial':>9} {'vs march':>8}")
        for r in native:
            one = r["speedup_vs_one_rank"]
            print(f"{r['ranks']:>5} {r['mgrit_train'] * 1e3:9.2f} "
                  f"{'-' if one is None else format(one, '9.2f'):>9} "
                  f"{r['speedup_vs_layerwise']:13.2f} {r['speedup_vs_serial']:9.2f} "
                  f"{r['speedup_vs_sequential_march']:8.2f}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scaling", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="cases:\n  w2       dense tanh ResNet, 1024 layers, batch 1 (the study)\n"
               "  w1-1024  conv ResNet, 1024 layers, batch 50 (the study)\n"
               + "\n".join(f"  {n:<8} {c.work().description.split(',')[0]}, {c.num_steps} layers "
                           "(--cases)"
                           for n, c in TRANSFORMER_CURVES.items())
               + "\n\nOUT_DIR docs/results --docs docs/scaling.md also rewrites the page's "
                 "generated tables\n(benchmarks/scaling/docs.py); the text around them stays.")
    parser.add_argument("out", type=Path, metavar="OUT_DIR", help="where the JSON record and "
                        "figures/ go (docs/results for the published ones)")
    parser.add_argument("--docs", type=Path, metavar="PAGE", help="after the study, rewrite "
                        "the generated tables of PAGE (docs/scaling.md) from OUT_DIR's records")
    parser.add_argument("--cases", help="comma-separated cases of the transformers' curves "
                        f"to predict instead of the study: {', '.join(TRANSFORMER_CURVES)}")
    parser.add_argument("--ranks", help="with --cases: comma-separated rank counts (default "
                        "1, 2, 4, ..., 1024; each case runs on those it can use)")
    args = parser.parse_args(argv)
    if args.docs and args.cases:
        parser.error("--docs goes with the study; the --cases records are written to the "
                     "page by python -m benchmarks.scaling.docs")
    if args.docs and not args.docs.is_file():
        parser.error(f"--docs {args.docs}: no such page")
    if args.ranks and not args.cases:
        parser.error("--ranks goes with --cases (the study's rank counts are fixed)")
    names = args.cases.split(",") if args.cases else []
    unknown = [n for n in names if n not in TRANSFORMER_CURVES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {', '.join(TRANSFORMER_CURVES)}")
    try:
        ranks = sorted({int(p) for p in args.ranks.split(",")}) if args.ranks else None
    except ValueError:
        parser.error(f"--ranks takes rank counts separated by commas, got {args.ranks!r}")
    if ranks and ranks[0] < 1:
        parser.error("--ranks: every rank count must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    result = transformer_study(names, ranks) if names else study()
    stem = "scaling-" + "-".join(names) if names else "scaling"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    # beside the other figures the docs show (docs/results/figures)
    (args.out / "figures").mkdir(exist_ok=True)
    plot(result, args.out / "figures" / f"{stem}.png")
    print_tables(result)
    if args.docs:
        from .docs import update

        log.info("rewrote %s in %s", ", ".join(update(args.docs, args.out, {"scaling.json"})),
                 args.docs)
