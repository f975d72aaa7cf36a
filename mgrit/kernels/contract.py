"""The step-strategy contract: what the network propagators (`mgrit.nn.engine.propagators`) call on
the strategy that computes a rank's residual steps u + dt f(u) and their adjoints, as typed
Protocols, checked once per strategy class (`check_strategy`) so that a missing or misnamed
method is an error when the strategy is chosen, not an AttributeError deep in a solve or a
compiled phase that silently never runs.

A strategy works on a layer's (or a batch of layers') tensors `t`, a dict of parameter name
to tensor as `LayerStack` hands them out. Every strategy is a `StepStrategy`; one whose
`keeps_values` is true is also a `KeptStrategy` (its forward steps can return their op
outputs, which the adjoint reuses instead of evaluating f again), one whose `keeps_values`
is false a `SingleAdjoint`. A strategy may also offer compiled relaxation phases: then it
is a `PhaseStrategy`, all of it.

Kept outputs are (outputs, k): layer k of the batch whose op outputs `outputs` (per op: a
stacked tensor or a list of per-layer tensors) a step returned. `skips_zeros` says whether
a strategy's adjoint handles all-zero cotangents itself; otherwise the caller skips them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from torch import Tensor

Tensors = dict[str, Tensor]
Kept = tuple[list, int]
Rows = list[tuple[Tensor, Tensor, "Tensor | None"]]


class StepStrategy(Protocol):
    """What every strategy offers (the two flags as class attributes)."""

    skips_zeros: bool
    keeps_values: bool

    def step(self, layer: int, t: Tensors, u: Tensor, dt: float) -> Tensor:
        """u + dt f(u) for one layer, a new tensor."""

    def batch(self, t: Tensors, states: Tensor, dt: float) -> Tensor:
        """The same for a batch of layers (leading dimension of t and states)."""

    def wants_values(self, want_params: bool) -> bool:
        """Whether `vjp` reads the op outputs (else the caller need not gather them)."""

    def vjp(self, t: Tensors, us: Tensor, ws: Tensor, dt: float, values: list | None,
            want_params: bool) -> tuple[Tensor, Tensors | None]:
        """(ws + dt (df/du)^T ws, the parameter cotangents (df/dtheta)^T ws or None)."""


class KeptStrategy(StepStrategy, Protocol):
    """A strategy whose steps write in place and can keep their op outputs."""

    def step_into(self, layer: int, t: Tensors, u: Tensor, dt: float, out: Tensor,
                  g: Tensor | None, keep: bool) -> Kept | None:
        """out = g + u + dt f(u) (g None: no g), in place; the kept outputs if `keep`."""

    def batch_into(self, t: Tensors, states: Tensor, dt: float, out: Tensor, g: Tensor | None,
                   keep: bool) -> list | None:
        """The same for a batch of layers."""

    def values(self, t: Tensors, us: Tensor) -> list:
        """The op outputs of f at a batch of states: what the adjoint linearises with."""

    def single_values(self, layer: int, t: Tensors, u: Tensor) -> Kept:
        """The kept outputs of one layer at state u."""

    def gather(self, us: Tensor, kept: list[Kept]) -> list:
        """Kept outputs of several layers as one batch's."""

    def vjp_single_into(self, layer: int, t: Tensors, w: Tensor, dt: float, out: Tensor,
                        g: Tensor | None, kept: Kept) -> None:
        """out = g + w + dt (df/du)^T w for one layer, from its kept outputs."""

    def record_single_into(self, layer: int, t: Tensors, u: Tensor, w: Tensor, dt: float,
                           out: Tensor, g: Tensor | None, kept: Callable[[], Kept]
                           ) -> Tensors | None:
        """`vjp_single_into` that also returns the layer's parameter cotangents as a batch
        of one, or None, having done nothing (the caller then takes a batch of one)."""


class SingleAdjoint(StepStrategy, Protocol):
    """A strategy that keeps no op outputs: one layer's adjoint step from its state."""

    def vjp_single(self, layer: int, u: Tensor, w: Tensor, dt: float) -> Tensor:
        """w + dt (df/du)^T w for one layer at state u."""


class PhaseStrategy(Protocol):
    """Optional: relaxation phases compiled into one call each (native, or planned on
    torch's kernels), which the solver's recorded cycles replay."""

    def program_parallel(self, values: int, adjoint: bool) -> int:
        """The most independent steps of states of `values` values that a phase takes."""

    def program(self, tensors: list[Tensors], rows: Rows, dt: float
                ) -> Callable[[], None] | None:
        """The steps out = g + u + dt f(u) for (u, out, g) in `rows`, as one call."""

    def keep_program(self, layers: list[int], tensors: list[Tensors], rows: Rows, dt: float
                     ) -> tuple[Callable[[], None], dict[int, Kept]] | None:
        """`program` for steps that keep their op outputs, and those outputs per layer."""

    def vjp_program(self, tensors: list[Tensors], ys: list[Tensor], rows: Rows, dt: float,
                    record: tuple[list[Tensor], Tensors, Sequence[int]] | None = None
                    ) -> Callable[[], None] | None:
        """The adjoint steps of `rows` as one call, from the values `ys[i]` that
        `phase_values` picked out of each step's kept outputs. With `record` = (forward
        states, cotangents from `phase_cotangents`, rows), step i also writes its
        parameter cotangents into row rows[i] of each."""

    def phase_values(self, kept: Kept) -> tuple[Tensor, object]:
        """What a compiled adjoint step reads of a layer's kept outputs, and the object it
        was read from: while the layer's kept outputs hold that same object at the same
        index, a compiled phase stays valid. The layout of kept outputs is the strategy's
        alone; the propagators only hand them back."""

    def phase_cotangents(self, t: Tensors, count: int) -> Tensors:
        """Empty parameter cotangents of `count` layers like `t`, keyed as a batch's are."""


@dataclass(frozen=True)
class Contract:
    """What a checked strategy class offers beyond `StepStrategy`."""

    phases: bool        # a `PhaseStrategy`: compiled relaxation phases may run on it


def _members(protocol: type) -> dict[str, Callable | None]:
    """The attributes a protocol asks for: its methods (with their signatures) and its
    annotated data attributes (None), its bases' included."""
    members: dict[str, Callable | None] = {}
    for cls in reversed(protocol.__mro__):
        if cls in (object, Protocol) or not getattr(cls, "_is_protocol", False):
            continue
        members.update({name: None for name in getattr(cls, "__annotations__", {})})
        members.update({name: value for name, value in vars(cls).items()
                        if not name.startswith("_") and inspect.isfunction(value)})
    return members


def _missing(cls: type, protocol: type) -> list[str]:
    """The members of `protocol` that `cls` lacks or cannot call with their arguments."""
    wrong = []
    for name, method in _members(protocol).items():
        found = getattr(cls, name, None)
        if found is None:
            wrong.append(name)
        elif method is not None:
            if not callable(found):
                wrong.append(f"{name} (not a method)")
                continue
            wanted = list(inspect.signature(method).parameters)
            try:
                inspect.signature(found).bind(*wanted)
            except TypeError:
                wrong.append(f"{name} (cannot be called as {name}({', '.join(wanted[1:])}))")
            except ValueError:      # a builtin: nothing to check
                pass
    return wrong


# strategy class -> its checked contract: strategies are chosen once per solve, and a
# class's methods do not change, so each class is checked once
_CHECKED: dict[type, Contract] = {}


def check_strategy(strategy: object) -> Contract:
    """The contract of `strategy`'s class, checked on first sight: TypeError naming what is
    missing where it is not a `StepStrategy`, lacks what its `keeps_values` promises
    (`KeptStrategy` or `SingleAdjoint`), or has some of `PhaseStrategy` but not all."""
    cls = type(strategy)
    contract = _CHECKED.get(cls)
    if contract is not None:
        return contract
    name = cls.__name__
    missing = _missing(cls, StepStrategy)
    if not missing:
        keeps = bool(getattr(strategy, "keeps_values"))
        extra = KeptStrategy if keeps else SingleAdjoint
        missing = _missing(cls, extra)
        what = f"{extra.__name__} (keeps_values is {keeps})"
    else:
        what = "StepStrategy"
    if missing:
        raise TypeError(f"the step strategy {name} is not a {what}: it lacks "
                        f"{', '.join(missing)} (mgrit.kernels.contract)")
    phase = _members(PhaseStrategy)
    partial = _missing(cls, PhaseStrategy)
    if partial and any(getattr(cls, method, None) is not None for method in phase):
        raise TypeError(f"the step strategy {name} has part of PhaseStrategy but lacks "
                        f"{', '.join(partial)}: define all of {', '.join(phase)} or none "
                        "(mgrit.kernels.contract)")
    contract = _CHECKED[cls] = Contract(phases=not partial)
    return contract


def has_phases(strategy: object) -> bool:
    """Whether a strategy offers compiled relaxation phases (checked once per class)."""
    return check_strategy(strategy).phases
