"""The methods layer-parallel training is predicted against past this machine: serial
PyTorch and layer-wise model parallelism, modelled from measured per-layer CPU costs of
the plain network, layer-wise model parallelism as traces to replay on an `Interconnect`."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from mgrit.app.replay import Event

from ..training import forward_fn
from .cases import ScalingCase, fastest


def _cpu_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return fastest(times)


def serial_costs(case: ScalingCase, depths: tuple[int, int], repeats: int = 3) -> dict[str, Any]:
    """Per-layer and fixed CPU seconds of serial PyTorch's training step phases (forward,
    backward, zero_grad + optimizer update) and of a no-grad forward, from timing the plain
    network at two depths: cost(n) = fixed + n * per_layer."""
    phases = {}
    for n in depths:
        work = case.work(n)
        torch.manual_seed(0)
        net = work.network()
        model = net.serial()
        x, y = work.inputs(torch.Generator().manual_seed(1))
        opt = work.optimizer(model.parameters())
        times: dict[str, list[float]] = {"forward": [], "backward": [], "update": []}
        # a training step written out (not `train_step`): each phase is timed on its own
        for k in range(repeats + 1):
            t0 = time.thread_time()
            opt.zero_grad()
            t1 = time.thread_time()
            loss = work.loss(model(x), y)
            t2 = time.thread_time()
            loss.backward()
            t3 = time.thread_time()
            opt.step()
            t4 = time.thread_time()
            if k:
                times["forward"].append(t2 - t1)
                times["backward"].append(t3 - t2)
                times["update"].append(t1 - t0 + t4 - t3)
        phases[n] = {k: fastest(v) for k, v in times.items()}
        phases[n]["inference"] = _cpu_time(forward_fn(model, x), repeats)
    n1, n2 = depths
    costs: dict[str, Any] = {"depths": list(depths)}
    for phase in ("forward", "backward", "update", "inference"):
        per_layer = (phases[n2][phase] - phases[n1][phase]) / (n2 - n1)
        costs[phase] = {"per_layer": per_layer,
                        "fixed": max(phases[n1][phase] - n1 * per_layer, 0.0)}
    state = net.opening(x) if net.opening is not None else x
    costs["state_bytes"] = state.numel() * state.element_size()
    return costs


def serial_seconds(costs: dict[str, Any], num_steps: int, phases: tuple[str, ...]) -> float:
    return sum(costs[p]["fixed"] + num_steps * costs[p]["per_layer"] for p in phases)


def layerwise_traces(costs: dict[str, Any], num_steps: int, ranks: int, train: bool
                     ) -> list[list[Event]]:
    """Layer-wise model parallelism: contiguous blocks of layers, rank p computing its block
    after receiving rank p-1's output (and, training, its gradient part after rank p+1's
    gradient, then updating its own layers). Fixed costs (opening, closing, loss) go to the
    last rank. A no-grad forward (`train=False`) uses the inference costs."""
    size = costs["state_bytes"]
    base, extra = divmod(num_steps, ranks)
    traces = []
    for p in range(ranks):
        n = base + (1 if p < extra else 0)
        last = p == ranks - 1
        fwd = costs["forward" if train else "inference"]
        events: list[Event] = []
        if p > 0:
            events.append(["wait", p - 1, "activation", 0])
        events.append(["compute", n * fwd["per_layer"] + (fwd["fixed"] if last else 0.0)])
        if not last:
            events.append(["send", p + 1, size, "activation", 0])
        if train:
            bwd, upd = costs["backward"], costs["update"]
            if not last:
                events.append(["wait", p + 1, "gradient", 0])
            events.append(["compute", n * bwd["per_layer"] + (bwd["fixed"] if last else 0.0)])
            if p > 0:
                events.append(["send", p - 1, size, "gradient", 0])
            events.append(["compute", n * upd["per_layer"] + (upd["fixed"] if last else 0.0)])
        traces.append(events)
    return traces


def fastest_serial(runs: list[dict[str, Any]], num_steps: int) -> dict[str, Any]:
    """Of several `serial_costs` runs, the one with the fastest training step at
    `num_steps` layers. A run whose fit has a layer costing less than nothing was disturbed
    between its two depths (a slow phase of the machine at the shallower one): its line
    through them is no cost model, and extrapolated it can even look fastest, so such runs
    are left out while any other is there."""
    phases = ("forward", "backward", "update", "inference")
    sound = [c for c in runs if all(c[k]["per_layer"] >= 0 for k in phases)]
    return min(sound or runs, key=lambda c: serial_seconds(c, num_steps, ("forward", "backward",
                                                                          "update")))
