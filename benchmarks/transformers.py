"""Accuracy of layer-parallel transformers against serial training: W4's validation loss and
W5's test accuracy after the same steps, same seed, same data order (docs/results.md,
"Layer-parallel transformers").

Serial training is exact PyTorch autograd on the plain network (`ResNetSpec.serial`); its
forward pass of step k runs inside `mgrit.nn.draws(seed, k)`, so its dropout drops what the
layer-parallel model's does in its step k (`mgrit.nn.layer_key`). Both start from the same
weights (the network built twice under one seed) and see the same batches (one generator
seed). The layer-parallel model runs in this one process: MGRIT's arithmetic is the same on
any number of ranks (docs/results.md, W3), so one process gives the curves of P ranks.
Evaluation is in eval mode, where the layer-parallel model steps its layers exactly, so the
validation loss and the test accuracy judge the weights that training reached, not the
few-cycle forward pass that training uses. The learning rate decays to zero over the run
(cosine), so the final weights have settled and the comparison is not of two points of a
still noisy curve. The variant "controller" trains with the default one's options and the
default controller (`mgrit.nn.Controller`) deciding from step 0: it probes the gradient
against exact stepping and changes the solvers between steps; its seconds per step include
the probes.

    python -m benchmarks.transformers --json FILE [--steps N] [--epochs E]
        [--w4-variants NAME,...] [--w5-variants NAME,...] [--w4-seeds K,...] [--w5-seeds K,...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mgrit.app.data import batches
from mgrit.app.loop import evaluate, train_step
from mgrit.core.config import Config
from mgrit.nn import Controller, LayerParallel, draws
from mgrit.nn.defaults import training_config

from .controller import controller_record
from .training import gradient_agreement, gradient_pairs
from .workloads import (W4_SETTINGS, W5_SETTINGS, TrainingWorkload, digit_images,
                        token_cross_entropy, topics_corpus, w4_workload, w5_workload)


@dataclass(frozen=True)
class Variant:
    """Solver settings of the layer-parallel model: its forward and backward `Config`s, and
    whether the default controller changes them during training (`controlled`)."""

    name: str
    forward: Config
    backward: Config
    controlled: bool = False


def _cycles(forward: int, backward: int, levels: int = 3, fine: str = "F") -> Variant:
    """`forward` and `backward` cycles of training's hierarchy with `levels` levels and
    `fine` relaxation on the fine level (FCF below)."""
    relax = (fine,) + ("FCF",) * (levels - 2) if levels > 1 else fine
    return Variant(f"{levels} levels, {'/'.join(relax)}, {forward}/{backward} cycles",
                   replace(training_config("forward", levels), max_iter=forward, relax=relax),
                   replace(training_config("backward", levels), max_iter=backward,
                           relax=relax))


SEQUENTIAL_ONE_LEVEL = Config(levels=1, tol=0.0, max_iter=1)
# the default first; the others are what to try when it does not reach parity: more
# forward or backward cycles, FCF-relaxation on the fine level, a shallower hierarchy, and
# exact sequential stepping (levels=1: serial's gradient, a check of the set-up); or the
# default controller, starting from the default's options, deciding for itself
VARIANTS = {
    "default": _cycles(2, 1),
    "controller": replace(_cycles(2, 1), name="controller, from 2/1 cycles", controlled=True),
    "3/1": _cycles(3, 1),
    "4/1": _cycles(4, 1),
    "3/2": _cycles(3, 2),
    "4/3": _cycles(4, 3),
    "fcf-2/1": _cycles(2, 1, fine="FCF"),
    "fcf-2/2": _cycles(2, 2, fine="FCF"),
    "2-levels": _cycles(2, 1, levels=2),
    "levels=1": Variant("levels=1 (exact)", SEQUENTIAL_ONE_LEVEL, SEQUENTIAL_ONE_LEVEL),
}
SERIAL = "serial pytorch"


def build_model(work: TrainingWorkload, variant: Variant | None, seed: int) -> nn.Module:
    """The plain network (`variant` None) or the layer-parallel one with `variant`'s solver
    settings, from the same initial weights for the same `seed`; the layer-parallel model's
    draws take `seed` too."""
    torch.manual_seed(seed)
    spec = work.network()
    if variant is None:
        return spec.serial()
    return spec.layer_parallel(forward=variant.forward, backward=variant.backward, seed=seed)


def _optimizer(work: TrainingWorkload, model: nn.Module, steps: int
               ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The workload's optimizer, its learning rate decaying to zero over `steps` (cosine)."""
    optimizer = work.optimizer(model.parameters())
    return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(steps, 1))


def _controller(model: nn.Module, variant: Variant | None) -> Controller | None:
    """The default controller of `model` where `variant` asks for one."""
    return Controller(model) if variant is not None and variant.controlled else None


def _run_record(controller: Controller | None) -> dict[str, Any]:
    """A run's record of its controller (`controller_record`): none without one."""
    return {} if controller is None else controller_record(controller)


def _step_draws(model: nn.Module, seed: int, step: int) -> contextlib.AbstractContextManager:
    """Serial training's draws of training step `step`: those of the layer-parallel model's
    step `step` (which it keys itself)."""
    if isinstance(model, LayerParallel):
        return contextlib.nullcontext()
    return draws(seed, step)


def _forward_residual(model: nn.Module) -> float | None:
    """The last residual of the latest forward solve (None for the plain network): after a
    training step, how far its few cycles left the states from the network's own."""
    if not isinstance(model, LayerParallel) or "forward" not in model.stats:
        return None
    return float(model.stats["forward"]["residuals"][-1])


def gradient_check(model: nn.Module, work: TrainingWorkload, x: Tensor, y: Tensor
                   ) -> dict[str, float]:
    """Cosine and relative error of the layer-parallel model's gradient on (x, y) against
    exact autograd at its current weights (`to_serial`), with the same dropout draws; empty
    for the plain network. The model's draw counter is put back after its pass, so training
    goes on with the draws it would have had without the check."""
    if not isinstance(model, LayerParallel):
        return {}
    exact = model.to_serial()
    exact.train()
    model.train()
    step = model.draw_step
    with draws(model.draw_seed, step):
        work.loss(exact(x), y).backward()
    model.zero_grad()
    work.loss(model(x), y).backward()
    model.draw_step = step
    agreement = gradient_agreement(gradient_pairs(model, exact))
    model.zero_grad()
    return {"gradient_" + k: v for k, v in agreement.items()}


@torch.no_grad()
def lm_loss(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 64) -> float:
    """Mean next-token cross entropy over the windows x (targets y), in eval mode."""
    model.eval()
    total = 0.0
    for start in range(0, len(x), batch_size):
        xb, yb = x[start: start + batch_size], y[start: start + batch_size]
        total += float(token_cross_entropy(model(xb), yb)) * yb.numel()
    return total / y.numel()


def validation_windows(context: int, count: int) -> tuple[Tensor, Tensor]:
    """`count` of the non-overlapping validation windows, evenly spaced over the
    validation text (always the same ones)."""
    x, y = topics_corpus().windows("validation", context)
    pick = torch.linspace(0, len(x) - 1, min(count, len(x))).round().long()
    return x[pick], y[pick]


def train_w4(variant: Variant | None, steps: int, eval_every: int, seed: int = 0,
             windows: int = 256, **settings: Any) -> dict[str, Any]:
    """Train W4 (`settings`: `w4_workload`'s keyword arguments in place of its defaults)
    serially (`variant` None) or layer-parallel for `steps` steps (one batch of random
    windows each, learning rate decaying to zero); the validation loss on `windows` fixed
    validation windows before training, every `eval_every` steps and at the end, and there
    for the layer-parallel model its gradient's agreement with the exact one on a fixed
    batch (`gradient_check`). A controlled variant's controller sees every validation
    loss after training has begun."""
    work = w4_workload(**settings)
    model = build_model(work, variant, seed)
    controller = _controller(model, variant)
    optimizer, schedule = _optimizer(work, model, steps)
    generator = torch.Generator().manual_seed(seed)
    vx, vy = validation_windows({**W4_SETTINGS, **settings}["context"], windows)
    probe = work.inputs(torch.Generator().manual_seed(seed + 1))
    curve = [{"step": 0, "validation_loss": lm_loss(model, vx, vy),
              **gradient_check(model, work, *probe)}]
    losses: list[float] = []
    seconds = 0.0
    for k in range(steps):
        x, y = work.inputs(generator)
        model.train()
        start = time.perf_counter()
        with _step_draws(model, seed, k):
            loss, _ = train_step(model, optimizer, work.loss, x, y, control=controller)
        seconds += time.perf_counter() - start
        schedule.step()
        losses.append(float(loss))
        if (k + 1) % eval_every == 0 or k + 1 == steps:
            residual = _forward_residual(model)     # before evaluation's own solve
            validation = lm_loss(model, vx, vy)
            if controller is not None:
                controller.validation(validation)
            curve.append({"step": k + 1, "train_loss": sum(losses) / len(losses),
                          "validation_loss": validation,
                          "forward_residual": residual, **gradient_check(model, work, *probe)})
            losses = []
    return {"workload": "w4", "method": SERIAL if variant is None else variant.name,
            "steps": steps, "validation_loss": curve[-1]["validation_loss"],
            "train_seconds": seconds, "seconds_per_step": seconds / max(steps, 1),
            "curve": curve, **_run_record(controller)}


def train_w5(variant: Variant | None, epochs: int, seed: int = 0, **settings: Any
             ) -> dict[str, Any]:
    """Train W5 (`settings`: `w5_workload`'s keyword arguments) serially (`variant` None)
    or layer-parallel for `epochs` epochs over the digits' training images in shuffled
    batches (learning rate decaying to zero); test loss and accuracy before training and
    after every epoch, and for the layer-parallel model its gradient's agreement with the
    exact one on a fixed batch (`gradient_check`). A controlled variant's controller sees
    every epoch's test loss."""
    work = w5_workload(**settings)
    batch = {**W5_SETTINGS, **settings}["batch"]
    split = digit_images()
    model = build_model(work, variant, seed)
    controller = _controller(model, variant)
    optimizer, schedule = _optimizer(work, model, epochs * (len(split.x_train) // batch))
    generator = torch.Generator().manual_seed(seed)
    loss_fn = nn.functional.cross_entropy
    probe = work.inputs(torch.Generator().manual_seed(seed + 1))
    test_loss, accuracy = evaluate(model, split.x_test, split.y_test, loss_fn)
    curve = [{"epoch": 0, "step": 0, "test_loss": test_loss, "test_accuracy": accuracy,
              **gradient_check(model, work, *probe)}]
    seconds, step = 0.0, 0
    for epoch in range(epochs):
        losses = []
        for x, y in batches(split.x_train, split.y_train, batch, generator):
            model.train()
            start = time.perf_counter()
            with _step_draws(model, seed, step):
                loss, _ = train_step(model, optimizer, loss_fn, x, y, control=controller)
            seconds += time.perf_counter() - start
            schedule.step()
            losses.append(float(loss))
            step += 1
        residual = _forward_residual(model)
        test_loss, accuracy = evaluate(model, split.x_test, split.y_test, loss_fn)
        if controller is not None:
            controller.validation(test_loss)
        curve.append({"epoch": epoch + 1, "step": step, "train_loss": sum(losses) / len(losses),
                      "test_loss": test_loss, "test_accuracy": accuracy,
                      "forward_residual": residual, **gradient_check(model, work, *probe)})
    return {"workload": "w5", "method": SERIAL if variant is None else variant.name,
            "epochs": epochs, "steps": step, "test_accuracy": curve[-1]["test_accuracy"],
            "test_loss": curve[-1]["test_loss"], "train_seconds": seconds,
            "seconds_per_step": seconds / max(step, 1), "curve": curve,
            **_run_record(controller)}


# parity: W4's validation loss within 2% of serial's, W5's test accuracy within half a
# percentage point of serial's
W4_TOLERANCE, W5_TOLERANCE = 0.02, 0.005


def parity(steps: int, eval_every: int, epochs: int, w4_variants: list[str],
           w5_variants: list[str], seed: int = 0, windows: int = 256,
           w4_seeds: tuple[int, ...] = (), w5_seeds: tuple[int, ...] = (),
           w4: dict[str, Any] | None = None, w5: dict[str, Any] | None = None
           ) -> dict[str, Any]:
    """Serial training and layer-parallel training with each of the variants (names of
    VARIANTS) of W4 for `steps` steps and of W5 for `epochs` epochs, all with `seed`, and
    their differences to serial; serial training again with each of `w4_seeds`, `w5_seeds`
    (other weights, data order and draws), for how far serial training itself moves with
    the seed. `w4`, `w5`: the workloads' settings in place of their defaults
    (`w4_workload`, `w5_workload`)."""
    w4, w5 = w4 or {}, w5 or {}
    w4_runs = [train_w4(VARIANTS.get(v), steps, eval_every, seed, windows, **w4)
               for v in [SERIAL, *w4_variants]]
    w5_runs = [train_w5(VARIANTS.get(v), epochs, seed, **w5) for v in [SERIAL, *w5_variants]]
    serial_loss, serial_accuracy = w4_runs[0]["validation_loss"], w5_runs[0]["test_accuracy"]
    for run in w4_runs[1:]:
        run["relative_difference"] = run["validation_loss"] / serial_loss - 1.0
        run["parity"] = abs(run["relative_difference"]) <= W4_TOLERANCE
    for run in w5_runs[1:]:
        run["difference"] = run["test_accuracy"] - serial_accuracy
        run["parity"] = abs(run["difference"]) <= W5_TOLERANCE
    w4_spread = [{"seed": k, **train_w4(None, steps, steps, k, windows, **w4)} for k in w4_seeds]
    w5_spread = [{"seed": k, **train_w5(None, epochs, k, **w5)} for k in w5_seeds]
    for run in w4_spread:
        run["relative_difference"] = run["validation_loss"] / serial_loss - 1.0
    for run in w5_spread:
        run["difference"] = run["test_accuracy"] - serial_accuracy
    variants = dict.fromkeys([*w4_variants, *w5_variants])
    return {"settings": {"w4": {**W4_SETTINGS, **w4, "steps": steps, "eval_every": eval_every,
                                "validation_windows": windows,
                                "description": w4_workload(**w4).description},
                         "w5": {**W5_SETTINGS, **w5, "epochs": epochs,
                                "description": w5_workload(**w5).description},
                         "seed": seed, "variants": {v: _describe(VARIANTS[v]) for v in variants},
                         "threads": torch.get_num_threads(), "torch": torch.__version__},
            "w4": w4_runs, "w5": w5_runs, "w4_serial_seeds": w4_spread,
            "w5_serial_seeds": w5_spread,
            "targets": {"w4_relative_difference": W4_TOLERANCE,
                        "w5_accuracy_difference": W5_TOLERANCE}}


def _describe(variant: Variant) -> dict[str, Any]:
    return {"name": variant.name, "forward": variant.forward.describe(),
            "backward": variant.backward.describe(), "controlled": variant.controlled}


def _agreement(run: dict[str, Any]) -> str:
    """The gradient's cosine with the exact one before training and at the end."""
    first, last = run["curve"][0], run["curve"][-1]
    if "gradient_cosine" not in last:
        return f"{'-':>13}"
    return f"{first['gradient_cosine']:6.3f}{last['gradient_cosine']:7.3f}"


def print_tables(result: dict[str, Any]) -> None:
    s = result["settings"]
    print(f"W4: {s['w4']['description']}; {s['w4']['steps']} steps, validation loss on "
          f"{s['w4']['validation_windows']} fixed validation windows, seed {s['seed']}")
    print(f"{'method':>28}  {'validation loss':>15}  {'vs serial':>9}  {'parity':>6}  "
          f"{'s per step':>10}  {'grad cos 0/end':>14}")
    for run in result["w4"]:
        diff = (f"{run['relative_difference']:+9.2%}" if "relative_difference" in run
                else f"{'-':>9}")
        ok = ("yes" if run["parity"] else "no") if "parity" in run else "-"
        print(f"{run['method']:>28}  {run['validation_loss']:15.4f}  {diff}  {ok:>6}  "
              f"{run['seconds_per_step']:10.3f}  {_agreement(run):>14}")
    _print_controllers(result["w4"])
    for run in result["w4_serial_seeds"]:
        print(f"{'serial pytorch, seed ' + str(run['seed']):>28}  {run['validation_loss']:15.4f}"
              f"  {run['relative_difference']:+9.2%}")
    print(f"validation loss every {s['w4']['eval_every']} steps")
    _print_curves(result["w4"], "step", "validation_loss", "{:20.4f}")
    print()
    print(f"W5: {s['w5']['description']}; {s['w5']['epochs']} epochs, seed {s['seed']}")
    print(f"{'method':>28}  {'test accuracy':>13}  {'vs serial':>9}  {'parity':>6}  "
          f"{'test loss':>9}  {'s per step':>10}  {'grad cos 0/end':>14}")
    for run in result["w5"]:
        diff = f"{run['difference'] * 100:+8.2f}p" if "difference" in run else f"{'-':>9}"
        ok = ("yes" if run["parity"] else "no") if "parity" in run else "-"
        print(f"{run['method']:>28}  {run['test_accuracy'] * 100:12.2f}%  {diff}  {ok:>6}  "
              f"{run['test_loss']:9.4f}  {run['seconds_per_step']:10.3f}  "
              f"{_agreement(run):>14}")
    _print_controllers(result["w5"])
    for run in result["w5_serial_seeds"]:
        print(f"{'serial pytorch, seed ' + str(run['seed']):>28}  "
              f"{run['test_accuracy'] * 100:12.2f}%  {run['difference'] * 100:+8.2f}p")
    print("test accuracy after every epoch")
    _print_curves(result["w5"], "epoch", "test_accuracy", "{:20.4f}")


def _print_controllers(runs: list[dict[str, Any]]) -> None:
    """What each controlled run's controller measured and changed."""
    for run in runs:
        if "probes" in run:
            changes = ", ".join(f"step {d['step']}: {d['from']} -> {d['to']}"
                                for d in run["decisions"]) or "none"
            print(f"{run['method']}: {run['probes']} probes ({run['probe_seconds']:.1f} s), "
                  f"gradient error at step 0 {run['first_error']:.3f}, median "
                  f"{run['median_error']:.3f}; setting at the end {run['final_setting']}; "
                  f"changes: {changes}")


def _print_curves(runs: list[dict[str, Any]], x: str, y: str, fmt: str) -> None:
    print(f"{x:>6}  " + "  ".join(f"{run['method'][:20]:>20}" for run in runs))
    for i, point in enumerate(runs[0]["curve"]):
        print(f"{point[x]:>6}  " + "  ".join(fmt.format(run["curve"][i][y]) for run in runs))


def _names(text: str, option: str) -> list[str]:
    names = [v for v in text.split(",") if v]
    if not names or any(v not in VARIANTS for v in names):
        raise SystemExit(f"{option} must name some of {', '.join(VARIANTS)}, got {text!r}")
    return names


def _seeds(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(k) for k in text.split(",") if k)
    except ValueError:
        raise SystemExit(f"{option} takes seeds separated by commas, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.transformers",
        description="Accuracy of layer-parallel transformers (W4, W5) against serial training.")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--steps", type=int, default=200, help="W4 training steps")
    parser.add_argument("--eval-every", type=int, default=25,
                        help="W4 steps between validation losses")
    parser.add_argument("--epochs", type=int, default=15, help="W5 training epochs")
    for name in ("w4", "w5"):
        parser.add_argument(f"--{name}-variants", default="default",
                            help=f"{name.upper()}'s layer-parallel solver settings, "
                            f"comma-separated: {', '.join(VARIANTS)}")
        parser.add_argument(f"--{name}-seeds", default="",
                            help=f"serial {name.upper()} runs with these seeds too, "
                            "comma-separated (the spread of serial training)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    w4_variants = _names(args.w4_variants, "--w4-variants")
    w5_variants = _names(args.w5_variants, "--w5-variants")
    w4_seeds, w5_seeds = _seeds(args.w4_seeds, "--w4-seeds"), _seeds(args.w5_seeds, "--w5-seeds")
    if args.steps < 1 or args.eval_every < 1 or args.epochs < 1:
        raise SystemExit("--steps, --eval-every and --epochs must be >= 1")
    torch.set_num_threads(1)
    result = parity(args.steps, args.eval_every, args.epochs, w4_variants, w5_variants,
                    args.seed, w4_seeds=w4_seeds, w5_seeds=w5_seeds)
    print_tables(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
