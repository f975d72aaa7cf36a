"""What the scaling study runs: its cases (training workloads at a depth, with a hierarchy),
the model each rank builds for them, and how a repeated time is read."""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from mgrit.comm.tracing import Tracer
from mgrit.nn import LayerParallel
from mgrit.nn.blocks import ResNetSpec
from mgrit.nn.defaults import training_options

from .. import workloads
from ..training import train_step_fn
from ..workloads import TRAINING_WORKLOADS, TrainingWorkload


@dataclass(frozen=True)
class ScalingCase:
    """A training workload of `benchmarks.workloads` at `num_steps` layers. `costed`: in
    virtual runs convolutions are charged from a cost table instead of computed. `levels`:
    a different MGRIT hierarchy depth (F-relaxation on the fine level, FCF below).
    `repeats`: traced training steps per virtual run, after `warmup` untraced ones;
    `processes`: virtual runs per point, each in a fresh process (the prediction is the
    fastest of all). `min_ranks`: the fewest ranks the case is predicted for."""

    name: str
    workload: str
    num_steps: int
    costed: bool
    levels: int | None = None
    repeats: int = 3
    processes: int = 1
    warmup: int = 3
    min_ranks: int = 1

    def usable(self, ranks: list[int]) -> list[int]:
        """The rank counts of `ranks` the case runs on: at least `min_ranks` (a costed case
        from 2: one rank would hold every layer's states), at most one layer per rank."""
        low = max(self.min_ranks, 2 if self.costed else 1)
        return [p for p in ranks if low <= p <= self.num_steps]

    def work(self, num_steps: int | None = None) -> TrainingWorkload:
        n = self.num_steps if num_steps is None else num_steps
        network = {"w1": workloads.w1, "w2": workloads.w2, "w4": workloads.w4,
                   "w5": workloads.w5}[self.workload]
        work = replace(TRAINING_WORKLOADS[self.workload](), network=lambda: network(num_steps=n))
        if self.levels is None:
            return work
        return work.with_solver(levels=self.levels,
                                relax=training_options("forward", self.levels)["relax"])


CURVES = {"w2": ScalingCase("w2", "w2", 1024, costed=False, repeats=3, processes=3),
          "w1-1024": ScalingCase("w1-1024", "w1", 1024, costed=True, repeats=1)}
# The transformers, predicted on request (`python -m benchmarks.scaling OUT_DIR --cases w4`),
# not in every study. Nothing is charged from a table: every virtual run computes the whole
# network for every rank count. W4 and W5 at their own depth (up to one layer per rank),
# and W4 with 1024 layers for 64 ranks and more: each rank count costs a whole step of 1024
# blocks, long enough that one warm-up step settles it.
TRANSFORMER_CURVES = {
    "w4": ScalingCase("w4", "w4", 32, costed=False, repeats=3, processes=2),
    "w5": ScalingCase("w5", "w5", 16, costed=False, repeats=3, processes=2),
    "w4-1024": ScalingCase("w4-1024", "w4", 1024, costed=False, repeats=1, warmup=1,
                           min_ranks=64)}
CHECKS = {"w2": CURVES["w2"], "w1": ScalingCase("w1", "w1", 32, costed=True, processes=2),
          "w4": TRANSFORMER_CURVES["w4"], "w5": TRANSFORMER_CURVES["w5"]}
# layer counts of the serial cost fits (cost = fixed + layers x per-layer) of every curve
SERIAL_DEPTHS = {"w2": (256, 1024), "w1-1024": (64, 128), "w4": (16, 32), "w5": (8, 16),
                 "w4-1024": (64, 128)}
W0_PROCESSES = 3


@contextlib.contextmanager
def torch_kernels() -> Iterator[None]:
    """Torch's kernels only while the context is entered (MGRIT_NATIVE=torch), for the
    study's MPI launches, its worker processes and the models it builds in-process through
    several layers of its own code; the variable's previous value comes back after. The
    library takes its choice by argument (`LayerParallel(kernels=...)`): this switch is
    the study's, whose methods must all compute on torch's kernels."""
    saved = os.environ.get("MGRIT_NATIVE")
    os.environ["MGRIT_NATIVE"] = "torch"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["MGRIT_NATIVE"]
        else:
            os.environ["MGRIT_NATIVE"] = saved


def fastest(times: Iterable[float]) -> float:
    """The time of a repeated measurement: the fastest repeat. On a shared machine slow
    phases (up to twice the time, lasting from milliseconds to seconds) come and go; the
    lower envelope is what repeats from run to run, and every time here, measured or
    predicted, is taken the same way."""
    return min(times)


def setup(work: TrainingWorkload, seed: int = 0
          ) -> tuple[ResNetSpec, list[nn.Module], Tensor, Tensor]:
    """The network, its layers (built in serial order, as every rank would) and a batch."""
    torch.manual_seed(seed)
    net = work.network()
    layers = [net.step() for _ in range(net.num_steps)]
    x, y = work.inputs(torch.Generator().manual_seed(1))
    return net, layers, x, y


def shared_model(work: TrainingWorkload, net: ResNetSpec, layers: list[nn.Module], comm: Any
                 ) -> LayerParallel:
    """A LayerParallel whose step factory hands out `layers` in order (so virtual ranks
    share one set of initial weights instead of each drawing all of them again)."""
    given = iter(layers)
    return LayerParallel(lambda: next(given), net.num_steps, net.t_final, work.forward,
                         work.backward, comm=comm, opening=copy.deepcopy(net.opening),
                         closing=copy.deepcopy(net.closing))


def traced_step(model: nn.Module, work: TrainingWorkload, x: Tensor, y: Tensor,
                tracer: Tracer | None = None) -> Callable[[], None]:
    """One optimiser step; the tracer (if any) marks "forward" when the loss is there."""
    return train_step_fn(model, work, x, y,
                         None if tracer is None else lambda: tracer.mark("forward"))
