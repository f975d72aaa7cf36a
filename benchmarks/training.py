"""Training benchmarks: W1, W2, W4 and W5 step times, W3 accuracy (docs/design.md, section 6;
W4 and W5's accuracy: `benchmarks.transformers`).

Serial PyTorch runs in the calling process; the layer-parallel model runs in this process
for one rank and under `mpiexec -n P` for more. Every figure is a ratio of methods timed
in the same invocation.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor, nn

from mgrit.app.data import digits
from mgrit.app.loop import evaluate, train_epoch, train_step
from mgrit.core.config import Config
from mgrit.nn import LayerParallel, choose_settings, draws
from mgrit.nn.controller import THRESHOLD
from mgrit.nn.defaults import training_config
from mgrit.kernels.strategies import is_dense_tanh

from .baselines import GPipe, LayerwiseModelParallel
from .timing import median_seconds
from .work import ratios, step_work
from .workloads import TRAINING_WORKLOADS, W3_SETTINGS, TrainingWorkload, digits_dense


def sequential_variant(work: TrainingWorkload) -> TrainingWorkload:
    """The workload stepped sequentially (levels=1, one pass each way) through the same
    LayerParallel code and kernels: what mgrit's kernels give without the algorithm."""
    sequential = Config(levels=1, tol=0.0, max_iter=1)
    return replace(work, forward=replace(sequential, execution=work.forward.execution),
                   backward=replace(sequential, execution=work.backward.execution))


def parallel_model(work: TrainingWorkload, seed: int = 0, comm: Any = None,
                   kernels: str | None = None) -> LayerParallel:
    """The workload's layer-parallel model computing with `kernels`, its initial weights
    drawn from `seed`."""
    torch.manual_seed(seed)
    return work.network().layer_parallel(forward=work.forward, backward=work.backward,
                                         comm=comm, kernels=kernels)


def serial_network(work: TrainingWorkload, seed: int = 0) -> nn.Sequential:
    """The workload's serial network, with the initial weights `parallel_model` draws from
    `seed` (the two draw the same numbers, so either leaves torch's generator in the same
    state)."""
    torch.manual_seed(seed)
    return work.network().serial()


def build(work: TrainingWorkload, seed: int = 0, comm: Any = None,
          kernels: str | None = None) -> tuple[LayerParallel, nn.Sequential]:
    """(layer-parallel model computing with `kernels`, serial network) with the same
    initial weights."""
    return parallel_model(work, seed, comm, kernels), serial_network(work, seed)


def train_step_fn(model: nn.Module, work: TrainingWorkload, x: Tensor, y: Tensor,
                  after_forward: Callable[[], None] | None = None) -> Callable[[], None]:
    """A callable of one training step of `model` on (x, y) with the workload's loss and
    optimizer (made once, here); `after_forward` as in `train_step`."""
    optimizer = work.optimizer(model.parameters())
    return lambda: train_step(model, optimizer, work.loss, x, y, after_forward)


def forward_fn(model: nn.Module, x: Tensor) -> Callable[[], None]:
    """A callable of one forward pass of `model` on x, without gradients."""
    def forward() -> None:
        with torch.no_grad():
            model(x)
    return forward


def gradient_quality(work: TrainingWorkload) -> dict[str, float]:
    """Cosine similarity and relative error of the layer-parallel gradient (the workload's
    cycles) against serial autograd's exact gradient, and the relative error of the
    layer-parallel forward pass's output against the serial one, at the same weights and
    batch. Both are in training mode: each serial pass makes the layer-parallel pass's
    dropout draws (`mgrit.nn.draws`), so the errors are the solver's alone."""
    model, serial = build(work)
    x, y = work.inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        with draws(model.draw_seed, model.draw_step):
            ref = serial(x)
        out = model(x)
    output_error = float((out - ref).norm() / ref.norm())
    with draws(model.draw_seed, model.draw_step):
        work.loss(serial(x), y).backward()
    work.loss(model(x), y).backward()
    return {**gradient_agreement(gradient_pairs(model, serial)),
            "output_relative_error": output_error}


def gradient_agreement(pairs: list[tuple[Tensor, Tensor]]) -> dict[str, float]:
    """Cosine similarity and relative error of the gradients (first of each pair) against
    the exact ones (second), all parameters as one vector."""
    dot = sum(float((a * b).sum()) for a, b in pairs)
    na = sum(float(a.pow(2).sum()) for a, _ in pairs)
    nb = sum(float(b.pow(2).sum()) for _, b in pairs)
    diff = sum(float((a - b).pow(2).sum()) for a, b in pairs)
    return {"cosine": dot / (na * nb) ** 0.5, "relative_error": (diff / nb) ** 0.5}


def gradient_pairs(model: LayerParallel, serial: nn.Sequential) -> list[tuple[Tensor, Tensor]]:
    """(layer-parallel, serial) gradient of every parameter, layer by layer."""
    pairs = []
    for name in model.layers.names:
        stacked = model.layers.params[name.replace(".", "__")].grad
        for n in range(model.num_steps):
            pairs.append((stacked[n], serial[n + 1].f.get_parameter(name).grad))
    for mine, ref in ((model.opening, serial[0]), (model.closing, serial[-1])):
        pairs += [(a.grad, b.grad) for a, b in zip(mine.parameters(), ref.parameters())]
    return pairs


def serial_times(work: TrainingWorkload, repeats: int) -> dict[str, float]:
    serial = timed_serial(work)
    return {"train_step": median_seconds(serial.step, repeats),
            "forward": median_seconds(serial.forward, repeats)}


# timed calls of one method in a row within a round of `_interleaved`
BLOCK = 6


def _interleaved(fns: dict[str, Callable[[], object]], repeats: int,
                 sync: Callable[[], None]) -> dict[str, tuple[float, float]]:
    """(median, min) seconds of `repeats` calls of each of `fns`, in rounds: each round
    runs every fn once untimed, then up to BLOCK timed calls of it, so that a slow spell of
    a shared machine falls on every method alike rather than on the one timed then, while
    each timed call finds the caches as its own previous call left them (one call after
    another method's, with the other model's weights in the caches, was 2.5x slower for
    W2's forward pass on 2 ranks); `sync` (a barrier of the ranks) before and after each
    call. The minimum is the call least touched by other work."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    while any(len(t) < repeats for t in times.values()):
        for name, fn in fns.items():
            fn()
            for _ in range(min(BLOCK, repeats - len(times[name]))):
                sync()
                start = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


class Timed(NamedTuple):
    """A model to time (layer-parallel, or the plain network of serial PyTorch): its
    training step and its forward pass."""

    model: nn.Module
    step: Callable[[], None]
    forward: Callable[[], None]


def timed(work: TrainingWorkload, model: nn.Module) -> Timed:
    """`model` with its training step and forward pass on the workload's fixed batch."""
    x, y = work.inputs(torch.Generator().manual_seed(1))
    return Timed(model, train_step_fn(model, work, x, y), forward_fn(model, x))


def timed_model(work: TrainingWorkload, comm: Any = None, kernels: str | None = None
                ) -> Timed:
    """The workload's layer-parallel model, built with `kernels`, with its callables."""
    return timed(work, parallel_model(work, comm=comm, kernels=kernels))


def timed_serial(work: TrainingWorkload) -> Timed:
    """The workload's plain network (serial PyTorch), with its callables."""
    return timed(work, serial_network(work))


def times_together(models: dict[str, Timed], repeats: int, comm: Any = None
                   ) -> dict[str, dict[str, Any]]:
    """Each model's training step, then its forward pass, timed in interleaved rounds
    (`_interleaved`), with its solves' stats after its last training step."""
    barrier = comm.Barrier if comm is not None else (lambda: None)
    steps = _interleaved({name: m.step for name, m in models.items()}, repeats, barrier)
    # a plain network (serial PyTorch) has no solves
    stats = {name: dict(getattr(m.model, "stats", {})) for name, m in models.items()}
    forwards = _interleaved({name: m.forward for name, m in models.items()}, repeats,
                            barrier)
    return {name: {"train_step": steps[name][0], "forward": forwards[name][0],
                   "stats": stats[name],
                   "min": {"train_step": steps[name][1], "forward": forwards[name][1]}}
            for name in models}


SERIAL = "serial pytorch"
TORCH_KERNELS = "layer-parallel mgrit, torch kernels"
SEQUENTIAL = "sequential stepping, mgrit kernels"
CHOSEN = "MGRIT, chosen hierarchy"
# the same choice with exact passes among the candidates: what a user of choose_settings
# gets, where a sequential sweep may be the faster pass
CHOSEN_ANY = "chosen settings, exact passes allowed"
CHOSEN_METHODS = {CHOSEN: False, CHOSEN_ANY: True}
HIERARCHY_KEYS = ("levels", "coarsening", "relax", "max_iter", "initial_guess", "agglomerate")


def chosen_variant(work: TrainingWorkload, comm: Any = None, exact_passes: bool = False
                   ) -> TrainingWorkload:
    """The workload with the settings `mgrit.nn.choose_settings` picks with
    `threshold=THRESHOLD` for its network on the ranks of `comm` (collective): of the
    cheapest by the calibrated cost model, the fastest on these ranks whose gradient error,
    measured on the workload's own batch against exact stepping, is within the controller's
    default threshold: the hierarchy, the cycles of either pass up to the workload's, and
    nested starts; with `exact_passes`, exact stepping of either pass or both too."""
    model = parallel_model(work, comm=comm)
    x, y = work.inputs(torch.Generator().manual_seed(1))
    forward, backward = choose_settings(model, lambda: work.loss(model(x), y),
                                        threshold=THRESHOLD, exact_passes=exact_passes)
    return replace(work, forward=forward, backward=backward)


def hierarchy(work: TrainingWorkload) -> dict[str, dict[str, Any]]:
    """The hierarchy options of a workload's two solves, as plain values."""
    return hierarchy_of(work.forward, work.backward)


def hierarchy_of(forward: Config, backward: Config) -> dict[str, dict[str, Any]]:
    """The hierarchy options of two solves' options, as plain values (a tensor guess,
    which no chosen setting has, as its kind's name)."""
    def value(cfg: Config, key: str) -> Any:
        v = getattr(cfg, key)
        return "tensor" if isinstance(v, Tensor) else v
    return {kind: {key: value(cfg, key) for key in HIERARCHY_KEYS}
            for kind, cfg in (("forward", forward), ("backward", backward))}


def with_hierarchy(work: TrainingWorkload, options: dict[str, dict[str, Any]]
                   ) -> TrainingWorkload:
    """`work` with the hierarchy options `hierarchy` gave (read back from a record)."""
    def config(base: Config, values: dict[str, Any]) -> Config:
        return replace(base, **{k: tuple(v) if isinstance(v, list) else v
                                for k, v in values.items()})
    return replace(work, forward=config(work.forward, options["forward"]),
                   backward=config(work.backward, options["backward"]))


def hierarchy_label(options: dict[str, dict[str, Any]]) -> str:
    """'L2 m8 F/FCF 2/1': levels, coarsening, relaxation per level, cycles each way, which
    passes start from the coarse levels' solution ('nested': both), and 'gathered' where a
    pass solves coarse levels on every rank (`Config.agglomerate`); 'exact' where both
    passes step exactly (levels 1), 'exact forward, ...' where one does, the rest the
    other pass's hierarchy."""
    f, b = options["forward"], options["backward"]

    def text(value: Any) -> str:
        return "/".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    if f["levels"] == 1 and b["levels"] == 1:
        return "exact"
    if f["levels"] == 1 or b["levels"] == 1:
        exact, kind, other = (("forward", "backward", b) if f["levels"] == 1
                              else ("backward", "forward", f))
        return (f"exact {exact}, L{other['levels']} m{text(other['coarsening'])} "
                f"{text(other['relax'])} {other['max_iter']} {kind}"
                + (" nested" if other.get("initial_guess") == "nested" else "")
                + (" gathered" if other.get("agglomerate") else ""))
    return (f"L{f['levels']} m{text(f['coarsening'])} {text(f['relax'])} "
            f"{f['max_iter']}/{b['max_iter']}" + _nested_label(f, b)
            + (" gathered" if f.get("agglomerate") or b.get("agglomerate") else ""))


def _nested_label(forward: dict[str, Any], backward: dict[str, Any]) -> str:
    nested = [kind for kind, options in (("forward", forward), ("backward", backward))
              if options.get("initial_guess") == "nested"]
    return " nested" if len(nested) == 2 else "".join(f" nested {kind}" for kind in nested)


def method_models(work: TrainingWorkload, comm: Any = None) -> dict[str, Timed]:
    """The layer-parallel model with the workload's setting and stepped sequentially; for
    a network whose layers have native kernels (convolutions, dense tanh steps) also with
    torch's kernels only (kernels="torch"), which is how much of its speed those kernels
    give."""
    out = {"layer-parallel mgrit": timed_model(work, comm),
           SEQUENTIAL: timed_model(sequential_variant(work), comm)}
    step = work.network().step()
    if is_dense_tanh(step) or any(isinstance(m, nn.Conv2d) for m in step.modules()):
        out[TORCH_KERNELS] = timed_model(work, comm, kernels="torch")
    return out


def layer_parallel_methods(work: TrainingWorkload, repeats: int, comm: Any = None
                           ) -> dict[str, dict[str, Any]]:
    """The times of `method_models`, timed together."""
    return times_together(method_models(work, comm), repeats, comm)


def all_methods(work: TrainingWorkload, repeats: int, comm: Any = None, serial: bool = False
                ) -> dict[str, dict[str, Any]]:
    """`layer_parallel_methods` and the settings chosen for the workload on the ranks of
    `comm` (`chosen_variant`, without and with exact passes among the choices, their rows
    after the workload's own setting's, with their options), all timed together; with
    `serial` (one process) serial PyTorch too, first, in the same rounds."""
    chosen = {method: chosen_variant(work, comm, exact_passes)
              for method, exact_passes in CHOSEN_METHODS.items()}
    methods = method_models(work, comm)
    first = "layer-parallel mgrit"
    models = {}
    if serial:
        models[SERIAL] = timed_serial(work)
    models |= {first: methods[first],
              **{method: timed_model(w, comm) for method, w in chosen.items()},
              **{k: v for k, v in methods.items() if k != first}}
    out = times_together(models, repeats, comm)
    for method, w in chosen.items():
        out[method]["hierarchy"] = hierarchy(w)
    return out


def baseline_times(work: TrainingWorkload, repeats: int, comm: Any
                   ) -> dict[str, dict[str, float]]:
    """Layer-wise model parallelism and GPipe over the ranks of `comm`, same network."""
    x, y = work.inputs(torch.Generator().manual_seed(1))
    serial = serial_network(work)
    layerwise = LayerwiseModelParallel(serial, comm, x, work.loss, work.optimizer)
    out = {"layer-wise model parallel": {
        "train_step": median_seconds(lambda: layerwise.train_step(x, y), repeats,
                                     comm.Barrier),
        "forward": median_seconds(lambda: layerwise.forward(x), repeats, comm.Barrier)}}
    serial = serial_network(work)
    gpipe = GPipe(serial, comm, work.microbatches, work.loss, work.optimizer)
    out[f"gpipe pipeline ({work.microbatches} micro-batches)"] = {
        "train_step": median_seconds(lambda: gpipe.train_step(x, y), repeats, comm.Barrier)}
    return out


def worker(name: str, repeats: int) -> dict[str, Any] | None:
    """Under mpiexec: time the layer-parallel model and, on more than one rank, the
    baselines, all in this one launch (W3: train it). The record on rank 0, None elsewhere."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if name == "w3":
        record = {"runs": [train_digits(comm=comm), train_digits(comm=comm, sequential=True)]}
    else:
        work = TRAINING_WORKLOADS[name]()
        record = all_methods(work, repeats, comm)
        if comm.size > 1:
            record.update(baseline_times(work, repeats, comm))
    return {"ranks": comm.size, **record} if comm.rank == 0 else None


def timing_records(name: str, ranks: list[int], repeats: int,
                   launch: Callable[[str, int, int], dict]) -> list[dict[str, Any]]:
    """Serial PyTorch and the layer-parallel model on each rank count, as records."""
    work = TRAINING_WORKLOADS[name]()
    runs = {p: all_methods(work, repeats, serial=True) if p == 1 else launch(name, p, repeats)
            for p in ranks}
    # serial PyTorch in the rounds of the one-process methods, where there are any: timed
    # apart, a shared machine's drift between the two would show as a ratio
    if 1 in runs:
        together = runs[1].pop(SERIAL)
        serial = {metric: together[metric] for metric in ("train_step", "forward")}
    else:
        serial = serial_times(work, repeats)
    # layer evaluations relative to sequential stepping (N forward + N adjoint), counted in
    # this process: the total over the ranks, which the rank count does not change
    work_ratios = {method: ratios(step_work(w)) for method, w in
                   (("layer-parallel mgrit", work), (SEQUENTIAL, sequential_variant(work)))}
    work_ratios[TORCH_KERNELS] = work_ratios["layer-parallel mgrit"]
    # the chosen settings may differ by rank count: their work is counted per choice
    chosen_ratios = {(p, method): ratios(step_work(with_hierarchy(
        work, runs[p][method]["hierarchy"]))) for p in ranks for method in CHOSEN_METHODS}
    records = []
    mgrit_name = "layer-parallel mgrit"
    for metric in ("train_step", "forward"):
        records.append({"workload": name, "method": SERIAL, "ranks": 1,
                        "metric": metric, "seconds": serial[metric], "ratio_to_serial": 1.0})
        base = runs[ranks[0]][mgrit_name][metric] * ranks[0]
        # the strongest sequential baseline: mgrit's own sequential stepping on the first
        # rank count (one rank, where --ranks starts at 1)
        sequential = runs[ranks[0]][SEQUENTIAL][metric]
        sequential_min = runs[ranks[0]][SEQUENTIAL]["min"][metric]
        for p in ranks:
            for method, times in runs[p].items():
                if method == "ranks" or metric not in times:
                    continue
                rec = {"workload": name, "method": method, "ranks": p, "metric": metric,
                       "seconds": times[metric], "ratio_to_serial": times[metric] / serial[metric],
                       "ratio_to_sequential": times[metric] / sequential,
                       "sequential_ranks": ranks[0]}
                if "min" in times:
                    rec["min_seconds"] = times["min"][metric]
                    rec["min_ratio_to_sequential"] = times["min"][metric] / sequential_min
                if method == mgrit_name:
                    rec["efficiency"] = base / (p * times[metric])
                if method in CHOSEN_METHODS:
                    rec["hierarchy"] = times["hierarchy"]
                    rec["hierarchy_label"] = hierarchy_label(times["hierarchy"])
                r = (chosen_ratios[p, method] if method in CHOSEN_METHODS
                     else work_ratios.get(method))
                if r is not None:
                    rec["evaluations_vs_sequential"] = (r["train_total"] if metric == "train_step"
                                                        else r["forward"])
                    rec["arithmetic_vs_sequential"] = (r["train_arithmetic"]
                                                       if metric == "train_step" else r["forward"])
                    rec["evaluations"] = r
                records.append(rec)
    quality = gradient_quality(work)
    records.append({"workload": name, "method": mgrit_name, "ranks": 1,
                    "metric": "gradient", "forward_cycles": work.forward.max_iter,
                    "backward_cycles": work.backward.max_iter, **quality,
                    "stats": runs[ranks[0]][mgrit_name]["stats"]})
    for p in ranks:
        for method in CHOSEN_METHODS:
            chosen = runs[p][method]["hierarchy"]
            records.append({"workload": name, "method": method, "ranks": p,
                            "metric": "gradient", "hierarchy_label": hierarchy_label(chosen),
                            "forward_cycles": chosen["forward"]["max_iter"],
                            "backward_cycles": chosen["backward"]["max_iter"],
                            **gradient_quality(with_hierarchy(work, chosen))})
    return records


def print_timing(name: str, records: list[dict[str, Any]]) -> None:
    work = TRAINING_WORKLOADS[name]()
    print(f"{name.upper()}: {work.description}")
    print(f"{'metric':>10}  {'method':>40}  {'ranks':>5}  {'ms':>9}  {'min ms':>9}  "
          f"{'vs serial':>9}  {'vs seq':>7}  {'min/seq':>7}  {'efficiency':>10}  "
          f"{'evals/seq':>9}  {'arith/seq':>9}")
    for rec in records:
        if rec["metric"] == "gradient":
            continue
        eff = f"{rec['efficiency']:10.2f}" if "efficiency" in rec else f"{'-':>10}"
        evals = rec.get("evaluations_vs_sequential")
        evals_text = (f"{evals:9.2f}  {rec['arithmetic_vs_sequential']:9.2f}"
                      if evals is not None else f"{'-':>9}  {'-':>9}")
        seq = (f"{rec['ratio_to_sequential']:7.2f}" if "ratio_to_sequential" in rec
               else f"{'-':>7}")
        least = (f"{rec['min_seconds'] * 1e3:9.2f}" if "min_seconds" in rec else f"{'-':>9}")
        least_seq = (f"{rec['min_ratio_to_sequential']:7.2f}"
                     if "min_ratio_to_sequential" in rec else f"{'-':>7}")
        print(f"{rec['metric']:>10}  {rec['method']:>40}  {rec['ranks']:>5}  "
              f"{rec['seconds'] * 1e3:9.2f}  {least}  {rec['ratio_to_serial']:9.2f}  {seq}  "
              f"{least_seq}  {eff}  {evals_text}")
    print("evals/seq: layer evaluations the solver asked (forward, adjoint, recomputed values; "
          "a coarse step counts as one) over sequential stepping's, all ranks together; "
          "arith/seq: those that cost arithmetic (zero cotangents map to zero for free); "
          "ms: median, min ms: fastest run; vs seq, min/seq: median and fastest over mgrit's "
          "own sequential stepping's (levels=1, same kernels) on "
          f"{next(r['sequential_ranks'] for r in records if 'sequential_ranks' in r)} rank(s), "
          "the strongest sequential baseline")
    for rec in records:
        if rec["metric"] == "gradient" and rec["method"] in CHOSEN_METHODS:
            print(f"{rec['method']} on {rec['ranks']} rank(s): {rec['hierarchy_label']}; "
                  "gradient "
                  f"vs exact: cosine {rec['cosine']:.4f}, relative error "
                  f"{rec['relative_error']:.3g}")
    grad = next(r for r in records if r["metric"] == "gradient")
    print(f"gradient with {grad['forward_cycles']} forward / {grad['backward_cycles']} backward "
          f"cycles vs exact: cosine {grad['cosine']:.4f}, relative error "
          f"{grad['relative_error']:.3f}; forward output vs serial: relative error "
          f"{grad['output_relative_error']:.1e}")


# W3: accuracy on digits -----------------------------------------------------------------

def train_digits(comm: Any = None, serial: bool = False, sequential: bool = False,
                 **overrides: Any) -> dict[str, Any]:
    """Train W3's network on digits with a fixed seed: layer-parallel with MGRIT, stepped
    sequentially through the same code (`sequential`: levels=1), or the plain network
    (`serial`); returns test accuracy (and, layer-parallel, the exported serial model's)."""
    s = {**W3_SETTINGS, **overrides}
    split = digits()
    torch.manual_seed(s["seed"])
    net = digits_dense(s["width"], s["num_steps"])
    if serial:
        model: nn.Module = net.serial()
    elif sequential:
        one_level = Config(levels=1, tol=0.0, max_iter=1)
        model = net.layer_parallel(forward=one_level, backward=one_level, comm=comm)
    else:
        model = net.layer_parallel(forward=training_config("forward"),
                                   backward=training_config("backward"), comm=comm)
    opt = torch.optim.SGD(model.parameters(), lr=s["lr"], momentum=0.9)
    gen = torch.Generator().manual_seed(s["seed"])
    loss_fn = nn.functional.cross_entropy
    start = time.perf_counter()
    for _ in range(s["epochs"]):
        train_epoch(model, opt, split.x_train, split.y_train, s["batch_size"], gen, loss_fn)
    seconds = time.perf_counter() - start
    _, accuracy = evaluate(model, split.x_test, split.y_test, loss_fn)
    method = ("serial pytorch" if serial else SEQUENTIAL if sequential
              else "layer-parallel mgrit")
    record = {"workload": "w3", "method": method,
              "metric": "test_accuracy", "value": accuracy, "train_seconds": seconds,
              "settings": s}
    if not serial:
        plain = model.to_serial()
        if plain is not None:
            record["exported_accuracy"] = evaluate(plain, split.x_test, split.y_test, loss_fn)[1]
    return record


def accuracy_records(ranks: list[int], launch: Callable[[str, int, int], dict]
                     ) -> list[dict[str, Any]]:
    records = [{"ranks": 1, **train_digits(serial=True)}]
    for p in ranks:
        runs = ([train_digits(), train_digits(sequential=True)] if p == 1
                else launch("w3", p, 1)["runs"])
        records += [{**rec, "ranks": p} for rec in runs]
    return records


def print_accuracy(records: list[dict[str, Any]]) -> None:
    s = records[0]["settings"]
    print(f"W3: digits, dense tanh ResNet width {s['width']}, N = {s['num_steps']}, "
          f"{s['epochs']} epochs, batch {s['batch_size']}, SGD({s['lr']}, 0.9), seed "
          f"{s['seed']}; MGRIT 3 levels, m = 4, 2 forward / 1 backward cycle")
    print(f"{'method':>34}  {'ranks':>5}  {'test accuracy':>13}  {'exported':>9}  {'train s':>8}")
    for rec in records:
        exported = (f"{rec['exported_accuracy'] * 100:8.2f}%" if "exported_accuracy" in rec
                    else f"{'-':>9}")
        print(f"{rec['method']:>34}  {rec['ranks']:>5}  {rec['value'] * 100:12.2f}%  "
              f"{exported}  {rec['train_seconds']:8.1f}")
