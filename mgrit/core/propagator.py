"""The propagator contract: what a user writes to have their time stepper solved."""

from __future__ import annotations

from typing import Iterator, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor


class Step(NamedTuple):
    """One step on one level: from point `index` to `index + 1`.

    `fine_index` is the level-0 step where it starts, `t` its start time and
    `dt` its length (h times the level's stride).
    """

    level: int
    index: int
    fine_index: int
    t: float
    dt: float


class StepBatch:
    """Independent steps of one level, one per interval, advanced in one call.

    The step indices form an arithmetic progression `start, start + stride, ...`
    of `count` terms; `index`, `fine_index` and `t` give them as tensors and
    `batch[i]` as a `Step`.
    """

    __slots__ = ("level", "start", "stride", "count", "level_stride", "t0", "h", "dt")

    def __init__(self, level: int, start: int, stride: int, count: int, level_stride: int,
                 t0: float, h: float) -> None:
        self.level = level
        self.start = start
        self.stride = stride
        self.count = count
        self.level_stride = level_stride
        self.t0 = t0
        self.h = h
        self.dt = h * level_stride

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> Step:
        if not 0 <= i < self.count:
            raise IndexError(i)
        index = self.start + i * self.stride
        fine = index * self.level_stride
        return Step(self.level, index, fine, self.t0 + fine * self.h, self.dt)

    def __iter__(self) -> Iterator[Step]:
        return (self[i] for i in range(self.count))

    @property
    def index(self) -> Tensor:
        return torch.arange(self.start, self.start + self.count * self.stride, self.stride)

    @property
    def fine_index(self) -> Tensor:
        return self.index * self.level_stride

    @property
    def t(self) -> Tensor:
        """Start times, float64, computed as t0 + fine_index * h like `Step.t`."""
        return self.fine_index.to(torch.float64) * self.h + self.t0


def make_step(level: int, index: int, level_stride: int, t0: float, h: float) -> Step:
    fine = index * level_stride
    return Step(level, index, fine, t0 + fine * h, h * level_stride)


@runtime_checkable
class Propagator(Protocol):
    """A one-step time integrator Phi: `step(u, s)` returns the state after step `s`.

    It may also define `step_batch(U, steps)`, advancing the states U[i]
    (stacked along dimension 0) by `steps[i]` in one call; MGRIT uses it to
    relax all intervals of a level at once. Both must return new tensors of
    the input's shape and dtype. An optional `fine_sweep(active)` is called
    with True before the last level-0 relaxation of every cycle and with False
    after that cycle's residual: the steps in between are one per fine step,
    taken from final values (the adjoint uses them for parameter gradients).
    An optional `step_into(u, s, out, g)` writes g + Phi(u) (g None: Phi(u)) into
    `out`; the sequential march uses it to save a temporary and a copy per step, and
    batched relaxation for a batch of one interval. An optional `graph_key()` lets
    Config.cuda_graphs capture its steps (see `mgrit.execute.SweepGraphs`): a hashable that
    changes when memory the steps read moves, or None while they must run eagerly.
    """

    def step(self, u: Tensor, s: Step) -> Tensor: ...


def has_batched_step(prop: object) -> bool:
    return callable(getattr(prop, "step_batch", None))


def step_sequentially(prop: Propagator, u0: Tensor, num_steps: int, t0: float,
                      t1: float) -> Tensor:
    """Plain time stepping: the states at all num_steps + 1 points, stacked.

    The reference MGRIT converges to; it uses the same `Step` records
    (t = t0 + n*h, h = (t1 - t0)/N) as the solver.
    """
    h = (t1 - t0) / num_steps
    states = [u0]
    u = u0
    for n in range(num_steps):
        u = prop.step(u, Step(0, n, n, t0 + n * h, h))
        states.append(u)
    return torch.stack(states)
