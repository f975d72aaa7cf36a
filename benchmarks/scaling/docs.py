"""The docs' measured tables (docs/scaling.md, results.md, performance.md), written from
the JSON records under docs/results/.

Each table sits between `<!-- begin generated: NAME -->` and `<!-- end generated -->`; a
rewrite replaces what lies between a table's markers and nothing else, so the hand-written
text around the tables (and tables no tool writes) survives every re-run of a study.

    python -m benchmarks.scaling.docs [--results docs/results] [--doc docs/scaling.md ...]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, Callable

BEGIN = "<!-- begin generated: {name} -->"
END = "<!-- end generated -->"


def replace_generated(text: str, name: str, body: str) -> str:
    """`text` with the lines between NAME's markers replaced by `body`; a ValueError names
    the section and the sections `text` has when NAME's markers are missing or unclosed."""
    begin = BEGIN.format(name=name)
    start = text.find(begin)
    if start < 0:
        raise ValueError(f"no section {name!r} (markers {begin!r}); the text has "
                         f"{generated_names(text) or 'none'}")
    inner = text.index("\n", start) + 1
    stop = text.find(END, inner)
    nested = text.find("<!-- begin generated:", inner)
    if stop < 0 or 0 <= nested < stop:
        raise ValueError(f"section {name!r} has no {END!r} before the next section")
    return text[:inner] + body.rstrip("\n") + "\n" + text[stop:]


def generated_names(text: str) -> list[str]:
    """The names of the generated sections in `text`, in order."""
    return re.findall(r"<!-- begin generated: ([a-z0-9][a-z0-9.-]*) -->", text)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def ranks_table(record: dict[str, Any]) -> str:
    """Measured runs on real ranks (benchmarks.scaling.ranks), the strongest baseline,
    layer-wise model parallelism, first."""
    cases = list(dict.fromkeys(r["case"] for r in record["rows"]))
    rows = [[r["case"].upper(), r["metric"], str(r["ranks"]), _ms(r["layerwise"]),
             _ms(r["serial"]), _ms(r["measured"]), f"**{r['speedup_vs_layerwise']:.2f}**",
             f"{r['speedup_vs_serial']:.2f}", f"{r['efficiency']:.2f}",
             _ms(r["predicted_from_mpi_traces"]), f"{r['error']:+.1%}"]
            for r in sorted(record["rows"], key=lambda r: (cases.index(r["case"]),
                                                          r["metric"] != "train", r["ranks"]))]
    return _table(["case", "metric", "ranks", "layer-wise MP", "serial PyTorch", "MGRIT",
                   "MGRIT vs layer-wise", "vs serial", "efficiency", "replayed from MPI traces",
                   "replay error"], rows)


def validation_table(result: dict[str, Any]) -> str:
    """The scaling study's check of its model against 1 and 2 real MPI ranks."""
    rows = [[r["case"].upper(), r["metric"], str(r["ranks"]), _ms(r["measured"]),
             _ms(r["predicted_from_mpi_traces"]), f"{r['error']:+.1%}",
             _ms(r["predicted_virtual"]), f"{r['virtual_error']:+.1%}"]
            for r in result["validation"]]
    return _table(["case", "metric", "ranks", "measured", "from MPI traces", "error",
                   "virtual ranks", "error"], rows)


def curve_table(result: dict[str, Any], case: str) -> str:
    """One predicted curve on the cluster network, layer-wise model parallelism first."""
    rows = [[str(r["ranks"]), _ms(r["layerwise_train"]), _ms(r["serial_train"]),
             _ms(r["mgrit_train"]), f"**{r['speedup_vs_layerwise']:.2f}**",
             f"{r['speedup_vs_serial']:.2f}", f"{r['forward_speedup_vs_layerwise']:.2f}",
             _ms(r["busy_mean"]), str(r["critical"]["hops"])]
            for r in result["curves"] if r["case"] == case and r["network"] == "cluster"]
    return _table(["ranks", "layer-wise MP step", "serial step", "MGRIT step",
                   "MGRIT vs layer-wise", "vs serial", "forward vs layer-wise",
                   "busy per rank", "hops on critical path"], rows)


def variants_table(result: dict[str, Any]) -> str:
    """W2 with other hierarchy depths."""
    rows = [[r["case"], str(r["ranks"]), _ms(r["layerwise_train"]), _ms(r["mgrit_train"]),
             f"{r['speedup_vs_layerwise']:.2f}", f"{r['speedup_vs_serial']:.2f}"]
            for r in result["variants"] if r["network"] == "cluster"]
    return _table(["variant", "ranks", "layer-wise MP step", "MGRIT step",
                   "MGRIT vs layer-wise", "vs serial"], rows)


def native_table(result: dict[str, Any]) -> str:
    """W2 on mgrit's own kernels against their strongest baseline, mgrit's own sequential
    march (levels=1) on one rank with the same kernels."""
    rows = [[str(r["ranks"]), _ms(r["sequential_march_train"]), _ms(r["mgrit_train"]),
             f"**{r['speedup_vs_sequential_march']:.2f}**",
             "-" if r["speedup_vs_one_rank"] is None else f"{r['speedup_vs_one_rank']:.2f}",
             f"{r['speedup_vs_layerwise']:.2f}", f"{r['speedup_vs_serial']:.2f}",
             _ms(r["busy_mean"]), str(r["critical"]["hops"])]
            for r in result["native"]]
    return _table(["ranks", "sequential march (1 rank)", "MGRIT step",
                   "MGRIT vs sequential march", "vs 1 rank", "vs layer-wise (torch)",
                   "vs serial (torch)", "busy per rank", "hops on critical path"], rows)


GPU_METHODS = [("serial pytorch, cuda graph", "serial PyTorch, one CUDA graph"),
               ("serial pytorch", "serial PyTorch, eager"),
               ("mgrit levels=1", "mgrit levels=1 (sequential stepping)"),
               ("mgrit batched", "MGRIT, batched relaxation"),
               ("mgrit cuda graphs", "MGRIT, batched + CUDA graphs"),
               ("mgrit streams", "MGRIT, streams")]
GPU_WORKLOADS = {"w2": "W2 (batch 1)", "w2b": "W2b (batch 32)", "w1": "W1 (conv, batch 50)"}


def gpu_table(record: dict[str, Any]) -> str:
    """benchmarks/gpu_check.py's speed section, serial PyTorch captured as one CUDA graph
    (the strongest baseline) first and every time against it: the run's own table for a
    record that gives every method's status (the current format), else the older one's."""
    if "unmeasured" in record:
        from benchmarks.gpu_check import speed_table

        return speed_table(record)
    rows = []
    for workload, label in GPU_WORKLOADS.items():
        for metric in ("train_step", "forward"):
            got = {r["method"]: r for r in record["speed"]
                   if r["workload"] == workload and r["metric"] == metric}
            if not got:
                continue
            best = got["serial pytorch, cuda graph"]["seconds"]
            eager = got["serial pytorch"]["seconds"]
            for k, (method, name) in enumerate(m for m in GPU_METHODS if m[0] in got):
                r = got[method]
                ratio = r["seconds"] / best
                mark = f"**{ratio:.2f}**" if method == "mgrit cuda graphs" else f"{ratio:.2f}"
                rows.append([label if k == 0 and metric == "train_step" else "",
                             metric.replace("_", " ") if k == 0 else "", name,
                             _ms(r["seconds"]), mark, f"{r['seconds'] / eager:.3f}",
                             str(r["host_launches"]), str(r["device_ops"])])
    return _table(["workload", "metric", "method", "time", "vs one CUDA graph",
                   "vs eager", "launches", "GPU ops"], rows)


def check_table(record: dict[str, Any]) -> str:
    """`make bench-check`'s figures (benchmarks/check.py --json), mgrit's own sequential
    stepping first where a figure has it."""
    order = sorted(record["results"], key=lambda f: ("sequential" not in f, f))
    rows = []
    for figure in order:
        r = record["results"][figure]
        rows.append([figure, f"{r['baseline_seconds'] * 1e3:.2f} ms",
                     f"{r['mgrit_seconds'] * 1e3:.2f} ms", f"**{r['speedup']:.2f}**",
                     f"{record['floors'][figure]:.2f}",
                     "MGRIT" if r["speedup"] > 1 else "the baseline"])
    return _table(["figure (MGRIT vs baseline)", "baseline", "MGRIT", "speedup",
                   "floor", "faster"], rows)


# section name -> (the record under docs/results it is written from, the writer)
SECTIONS: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "validation": ("scaling.json", validation_table),
    "curve-w2": ("scaling.json", lambda r: curve_table(r, "w2")),
    "curve-w1-1024": ("scaling.json", lambda r: curve_table(r, "w1-1024")),
    "variants": ("scaling.json", variants_table),
    "validation-w4": ("scaling-w4.json", validation_table),
    "curve-w4": ("scaling-w4.json", lambda r: curve_table(r, "w4")),
    "curve-w4-1024": ("scaling-w4-1024.json", lambda r: curve_table(r, "w4-1024")),
    "curve-w5": ("scaling-w5.json", lambda r: curve_table(r, "w5")),
    "native": ("scaling.json", native_table),
    "ranks-h200": ("ranks-h200.json", ranks_table),
    "gpu-h200": ("gpu-h200.json", gpu_table),
    "bench-check": ("bench-check.json", check_table),
}


def gpu_targets_table(record: dict[str, Any]) -> str:
    """benchmarks/gpu_check.py's targets: each captured setting's time over serial
    PyTorch's in one CUDA graph, its error and whether it meets the target."""
    from benchmarks.gpu_check import targets_table

    return targets_table(record)


# the records of a device run, named by its GPU (`benchmarks.gpu_check.slug`): section
# prefix -> (the record's name from the rest of the section's name, the writer)
DEVICE_SECTIONS: dict[str, tuple[Callable[[str], str], Callable[[dict[str, Any]], str]]] = {
    "gpu-targets-": (lambda device: f"gpu-{device}.json", gpu_targets_table),
    "gpu-": (lambda device: f"gpu-{device}.json", gpu_table),
    "ranks-": (lambda device: f"ranks-{device}.json", ranks_table),
}


def section(name: str) -> tuple[str, Callable[[dict[str, Any]], str]] | None:
    """The record and the writer of section `name`: a fixed one of `SECTIONS`, else a
    device run's (`DEVICE_SECTIONS`, e.g. "gpu-h100-80gb-hbm3" from
    gpu-h100-80gb-hbm3.json); None if no writer knows it."""
    if name in SECTIONS:
        return SECTIONS[name]
    for prefix, (record, write) in DEVICE_SECTIONS.items():
        if name.startswith(prefix) and len(name) > len(prefix):
            return record(name[len(prefix):]), write
    return None


def update(doc: Path, results: Path, only: set[str] | None = None) -> list[str]:
    """Rewrite the generated sections that `doc` has (those written from the records named
    in `only`, or all) from the records in `results`; the names of the sections written.
    A section no writer knows is an error, before anything is written."""
    text = doc.read_text()
    unknown = [n for n in generated_names(text) if section(n) is None]
    if unknown:
        devices = ", ".join(prefix + "DEVICE" for prefix in DEVICE_SECTIONS)
        raise ValueError(f"{doc}: no writer for generated section(s) {unknown}; known: "
                         f"{', '.join(SECTIONS)} and {devices}")
    written = []
    for name in generated_names(text):
        record, write = section(name)
        if only is not None and record not in only:
            continue
        text = replace_generated(text, name, write(json.loads((results / record).read_text())))
        written.append(name)
    doc.write_text(text)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scaling.docs",
        description="Rewrite the generated tables of the docs from the JSON records; "
                    "the text between them stays as written.",
        epilog="sections: " + ", ".join(f"{n} (from {r})" for n, (r, _) in SECTIONS.items())
        + "; and a device run's: " + ", ".join(f"{p}DEVICE (from {r('DEVICE')})"
                                               for p, (r, _) in DEVICE_SECTIONS.items()))
    parser.add_argument("--results", type=Path, default=Path("docs/results"),
                        help="folder of the JSON records (default: docs/results)")
    parser.add_argument("--doc", type=Path, action="append", help="a page to rewrite, "
                        "repeatable (default: docs/scaling.md, results.md and performance.md)")
    args = parser.parse_args(argv)
    for doc in args.doc or [Path(f"docs/{n}.md") for n in ("scaling", "results", "performance")]:
        print(f"{doc}: rewrote", ", ".join(update(doc, args.results)) or "nothing")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
