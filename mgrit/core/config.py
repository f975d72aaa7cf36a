"""Solver options: a frozen dataclass validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch

RELAX_KINDS = ("F", "FCF")
CYCLE_KINDS = ("V", "F")
GUESS_KINDS = ("zero", "nested", "warm")
TOL_KINDS = ("absolute", "relative")
EXECUTIONS = ("auto", "loop", "batched")
# executors that existed once, and why they are gone: a config naming one gets the reason
RETIRED_EXECUTIONS = {
    "streams": "execution='streams' (interval groups on separate CUDA streams) was retired: "
               "on an H200 it took 30 to 50 times as long as 'batched' on every workload "
               "measured, forward and training step alike (docs/results.md, "
               "docs/results/gpu-h200.json); use execution='batched' (or 'auto'), with "
               "cuda_graphs=True on a GPU",
}


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(map(repr, choices))}")


def _per_level(name: str, value: Any, levels: int) -> tuple:
    """A scalar option or one value per coarsening step (levels - 1 of them)."""
    if isinstance(value, (list, tuple)):
        if len(value) < levels - 1:
            raise ValueError(f"{name} lists {len(value)} values but levels={levels} "
                             f"needs {levels - 1} (one per level above the coarsest)")
        return tuple(value)
    return (value,) * max(levels - 1, 1)


@dataclass(frozen=True)
class Config:
    """Options of one MGRIT solve (docs/design.md, section 2, defines each).

    levels:         most levels of the hierarchy (1 = sequential time stepping)
    coarsening:     factor m between levels; an int or one per level
    min_coarse:     stop coarsening before a level would have fewer steps
    relax:          "F" or "FCF"; a string or one per level
    relax_sweeps:   number nu of CF pairs in FCF relaxation, F(CF)^nu
    c_weight:       weight w of C-relaxation, u_c = w*(g + Phi(u)) + (1-w)*u_c
    cycle:          "V" or "F"
    initial_guess:  "zero", "nested", "warm" (the states of the same Solver's previous
                    solve; zero on its first), or a tensor of shape (N+1, *u0.shape)
    tol, tol_kind:  stop when residual <= tol ("absolute") or <= tol times
                    the initial residual ("relative")
    max_iter:       most cycles; 0 (no cycle: the nested guess F-relaxed once) only with
                    initial_guess="nested", levels >= 2 and tol = 0
    divergence_factor: a residual above this multiple of the first one, or
                    one that is not finite, stops the solve with DivergenceError
    execution:      "auto" (batched when the propagator has step_batch), "loop" or
                    "batched" ("streams" was retired: `RETIRED_EXECUTIONS` says why)
    cuda_graphs:    capture each relaxation sweep (the batched sub-steps of an
                    F-relaxation, a sequential march) in a CUDA graph at its second use
                    and replay it after, where the states are CUDA tensors and the
                    propagator allows it (`graph_key`); with the "loop" or "batched"
                    executor. No effect on a CPU.
    agglomerate:    solve the coarse levels with at most this many steps per rank on every
                    rank, after one reduction that brings them their right-hand side, in
                    place of passing them from rank to rank (`mgrit.core.agglomerate`;
                    a nested start needs no reduction); 0 (the default): never. Same
                    results to the bit; on one rank no effect. A layer-parallel network
                    fetches the layers (and the adjoint the forward states) those levels'
                    steps read at every pass
    """

    levels: int = 2
    coarsening: int | tuple[int, ...] = 2
    min_coarse: int = 2
    relax: str | tuple[str, ...] = "FCF"
    relax_sweeps: int = 1
    c_weight: float = 1.0
    cycle: str = "V"
    initial_guess: str | torch.Tensor = field(default="zero", compare=False)
    tol: float = 1e-9
    tol_kind: str = "absolute"
    max_iter: int = 100
    divergence_factor: float = 1e4
    execution: str = "auto"
    cuda_graphs: bool = False
    agglomerate: int = 0

    def __post_init__(self) -> None:
        _check_int("levels", self.levels, 1)
        coarsening = _per_level("coarsening", self.coarsening, self.levels)
        for m in coarsening:
            _check_int("coarsening", m, 2)
        object.__setattr__(self, "coarsening",
                           coarsening if isinstance(self.coarsening, (list, tuple)) else self.coarsening)
        relax = _per_level("relax", self.relax, self.levels)
        for r in relax:
            _check_choice("relax", r, RELAX_KINDS)
        object.__setattr__(self, "relax",
                           relax if isinstance(self.relax, (list, tuple)) else self.relax)
        _check_int("min_coarse", self.min_coarse, 1)
        _check_int("relax_sweeps", self.relax_sweeps, 1)
        _check_int("max_iter", self.max_iter, 0)
        for name in ("c_weight", "tol", "divergence_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"{name} must be a finite number, got {value!r}")
        if self.c_weight <= 0:
            raise ValueError(f"c_weight must be > 0, got {self.c_weight}")
        if self.tol < 0:
            raise ValueError(f"tol must be >= 0, got {self.tol}")
        if self.divergence_factor <= 1:
            raise ValueError(f"divergence_factor must be > 1, got {self.divergence_factor}")
        _check_choice("cycle", self.cycle, CYCLE_KINDS)
        _check_choice("tol_kind", self.tol_kind, TOL_KINDS)
        if self.execution in RETIRED_EXECUTIONS:
            raise ValueError(RETIRED_EXECUTIONS[self.execution])
        _check_choice("execution", self.execution, EXECUTIONS)
        if not isinstance(self.cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        _check_int("agglomerate", self.agglomerate, 0)
        if self.cuda_graphs and self.agglomerate:
            raise ValueError("cuda_graphs=True and agglomerate > 0 cannot be combined: the "
                             "gathered levels' sweeps would share the graphs of the levels "
                             "they copy; set agglomerate=0 or cuda_graphs=False")
        guess = self.initial_guess
        if not isinstance(guess, torch.Tensor) and guess not in GUESS_KINDS:
            raise ValueError(f"initial_guess={guess!r} is not valid; choose one of "
                             f"{', '.join(map(repr, GUESS_KINDS))} or a tensor of shape (N+1, *u0.shape)")
        if self.max_iter == 0 and (isinstance(guess, torch.Tensor) or guess != "nested"
                                   or self.levels < 2 or self.tol > 0):
            raise ValueError("max_iter=0 (no cycle: the nested start, F-relaxed once) needs "
                             "initial_guess='nested', levels >= 2 and tol=0; got "
                             f"initial_guess={'a tensor' if isinstance(guess, torch.Tensor) else repr(guess)}, "
                             f"levels={self.levels}, tol={self.tol}")

    def coarsening_at(self, level: int) -> int:
        """Coarsening factor from `level` to `level + 1`."""
        if isinstance(self.coarsening, tuple):
            return self.coarsening[level]
        return self.coarsening

    def coarsening_list(self) -> tuple[int, ...]:
        return tuple(self.coarsening_at(level) for level in range(max(self.levels - 1, 1)))

    def relax_at(self, level: int) -> str:
        if isinstance(self.relax, tuple):
            return self.relax[level]
        return self.relax

    def cf_sweeps_at(self, level: int) -> int:
        """How many CF pairs follow the leading F-relaxation on `level`."""
        return self.relax_sweeps if self.relax_at(level) == "FCF" else 0

    def describe(self) -> dict[str, Any]:
        """The options as plain values (a guess tensor is named by shape and dtype)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        _check_int("agglomerate", self.agglomerate, 0)
        if self.cuda_graphs and self.agglomerate:
            raise ValueError("cuda_graphs=True and agglomerate > 0 cannot be combined: the "
                             "gathered levels' sweeps would share the graphs of the levels "
                             "they copy; set agglomerate=0 or cuda_graphs=False")
        guess = self.initial_guess
        if isinstance(guess, torch.Tensor):
            out["initial_guess"] = f"tensor{tuple(guess.shape)}:{guess.dtype}"
        return out
