"""The propagator contract: what a user writes to have their time stepper solved."""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, NamedTuple, Protocol, runtime_checkable

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
    """A one-step time integrator Phi: `step(u, s)` returns the state after step `s`, a new
    tensor of u's shape and dtype. That is all MGRIT needs; the protocols below are optional
    capabilities that make it faster, each found (and checked) once when a solver is built
    (`Capabilities.of`)."""

    def step(self, u: Tensor, s: Step) -> Tensor: ...


@runtime_checkable
class BatchedPropagator(Protocol):
    """`step_batch(U, steps)` advances the states U[i] (stacked along dimension 0) by
    `steps[i]` in one call and returns them stacked: relaxation advances all intervals of a
    level at once with it (`Config.execution` "auto" or "batched")."""

    def step_batch(self, states: Tensor, steps: StepBatch) -> Tensor: ...


@runtime_checkable
class InPlacePropagator(Protocol):
    """`step_into(u, s, out, g)` writes g + Phi(u) (g None: Phi(u)) into `out`: the
    sequential march and a batch of one interval take it, saving a temporary and a copy per
    step. It must round as `g + step(u, s)` does, so that every path gives the same bits."""

    def step_into(self, u: Tensor, s: Step, out: Tensor, g: Tensor | None) -> None: ...


@runtime_checkable
class BatchedInPlacePropagator(Protocol):
    """`step_batch_into(U, steps, out, g)`: `step_into` for a batch, what F-relaxation's
    sub-steps take in place of `step_batch` and a copy."""

    def step_batch_into(self, states: Tensor, steps: StepBatch, out: Tensor,
                        g: Tensor | None) -> None: ...


@runtime_checkable
class CapturablePropagator(Protocol):
    """`graph_key()` lets `Config.cuda_graphs` capture the propagator's steps in CUDA graphs
    (see `mgrit.execute.SweepGraphs`): a hashable that changes when memory the steps read
    moves, or None while they must run eagerly."""

    def graph_key(self) -> Hashable | None: ...


@runtime_checkable
class CompiledPropagator(Protocol):
    """`step_program(steps, rows, parallel)` compiles a relaxation phase: the steps
    out = g + Phi(u) for (u, out, g) in `rows` (g None: none), taken in the order given
    (a later step may read what an earlier one wrote), as one callable; None where it
    cannot. `parallel` says how many of the steps are independent of each other.
    `program_key(level, parallel)` says what a phase of that level with `parallel`
    independent steps, compiled now, is valid for (the solver compiles a phase again when
    the key changes), or None where such a phase runs step by step; it is asked before
    every run of a phase that is not replayed, so it must be cheap. Keys may change
    between cycles and at the solver's final-sweep hook, not within a cycle otherwise:
    a cycle whose phases are all compiled is recorded and replayed while the keys asked
    before its first hook call stay the same (`mgrit.core.schedule`). A phase must give
    the bits its steps give one by one."""

    def step_program(self, steps: list[Step], rows: list[tuple[Tensor, Tensor, Tensor | None]],
                     parallel: int) -> Callable[[], None] | None: ...

    def program_key(self, level: int, parallel: int) -> Hashable | None: ...


# optional method -> its argument names (for the check of a method's signature)
OPTIONAL: dict[str, tuple[str, ...]] = {
    "step_batch": ("states", "steps"),
    "step_into": ("u", "s", "out", "g"),
    "step_batch_into": ("states", "steps", "out", "g"),
    "graph_key": (),
    "step_program": ("steps", "rows", "parallel"),
    "program_key": ("level", "parallel"),
    "gather_steps": ("grids", "comm"),
}


@dataclass(frozen=True)
class Capabilities:
    """A propagator's step and its optional capabilities as bound methods (None where it has
    none), found once when a solver is built so that no step asks again."""

    step: Callable[[Tensor, Step], Tensor]
    step_batch: Callable[[Tensor, StepBatch], Tensor] | None = None
    step_into: Callable[[Tensor, Step, Tensor, Tensor | None], None] | None = None
    step_batch_into: Callable[[Tensor, StepBatch, Tensor, Tensor | None], None] | None = None
    graph_key: Callable[[], Hashable | None] | None = None
    step_program: Callable[..., Callable[[], None] | None] | None = None
    program_key: Callable[[int, int], Hashable | None] | None = None
    # told once, by a solver that gathers coarse levels (`Config.agglomerate`), the grids
    # whose every step each rank will take and the communicator: a propagator with
    # `local_steps` then fetches what those steps read before each solve
    gather_steps: Callable[[list, Any], None] | None = None
    # the propagator's steps read data that only the rank the grid gives them holds (a
    # network's layers and forward states): `local_steps = True` on the propagator. Such
    # steps run on every rank only where the propagator fetches that data (`gather_steps`);
    # without it, such a propagator refuses `Config.agglomerate`
    local_steps: bool = False

    @classmethod
    def of(cls, prop: object) -> "Capabilities":
        """The capabilities of `prop`, checked: `step` must be there; an optional method must
        be callable with its arguments; a public method whose name is a near miss of an
        optional one (`step_bacth`) is an error, since it would silently never be called.
        The signatures and the near-miss search are checked once per propagator class and
        set of instance attributes: `mgrit.solve` builds a solver per call, and they would
        cost a short solve a few percent."""
        name = type(prop).__name__
        if not callable(getattr(prop, "step", None)):
            raise TypeError(f"the propagator {name} has no step(u, s) method")
        found = {method: getattr(prop, method, None) for method in OPTIONAL}
        for method, fn in found.items():
            if fn is not None and not callable(fn):
                raise TypeError(f"{name}.{method} is {type(fn).__name__}, not a method; "
                                f"define {method}({', '.join(OPTIONAL[method])}) or leave it "
                                "out")
        key = (type(prop), tuple(getattr(prop, "__dict__", ())))
        if key not in _CHECKED:
            _check(prop, found)
            _CHECKED.add(key)
        return cls(step=prop.step, local_steps=getattr(prop, "local_steps", False) is True,
                   **{k: fn for k, fn in found.items() if fn is not None})


# (propagator class, its instance's attribute names) whose capabilities passed `_check`
_CHECKED: set[tuple[type, tuple[str, ...]]] = set()


def _check(prop: object, found: dict[str, Callable | None]) -> None:
    """Raise TypeError for an optional method that cannot take its arguments, and for a
    public method named like a missing optional one."""
    name = type(prop).__name__
    for method, fn in found.items():
        if fn is not None:
            _check_arguments(name, method, fn, OPTIONAL[method])
    known = {"step", *OPTIONAL}
    for attr in dir(prop):
        if attr.startswith("_") or attr in known:
            continue
        near = difflib.get_close_matches(attr, OPTIONAL, n=1, cutoff=0.85)
        if near and found[near[0]] is None and callable(getattr(prop, attr, None)):
            raise TypeError(
                f"{name}.{attr} looks like a misspelt {near[0]}, one of the optional "
                f"propagator methods ({', '.join(OPTIONAL)}): as written MGRIT never "
                f"calls it; rename it to {near[0]} (or give it a name that is not "
                "close to one of those)")


def _check_arguments(name: str, method: str, fn: Callable, arguments: tuple[str, ...]) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):     # a builtin or C function: nothing to check
        return
    try:
        signature.bind(*arguments)
    except TypeError:
        raise TypeError(f"{name}.{method}{signature} cannot be called as "
                        f"{method}({', '.join(arguments)})") from None


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
