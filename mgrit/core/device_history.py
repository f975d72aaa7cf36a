"""The residual history of a captured solve: every cycle's norm kept as a device tensor in
buffers that stay where they are from solve to solve, nothing read on the host.

A CUDA graph replays kernels on the memory they were captured with and runs no Python, so
a solve inside one can neither stop at a tolerance nor raise at a divergent cycle: it runs
its `max_iter` cycles, and whoever holds the graph reads the norms after it (`check`), when
the numbers are there. The values are those of `History` and `DeferredHistory` to the bit:
the same squared parts in float64, summed over the ranks and square-rooted (both correctly
rounded)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .residual import History, Residuals, check_divergence


class DeviceNorms:
    """One solver's static buffers: the squared parts and the norms, float64 on the states'
    device. They grow (are made again) only while a solve runs more cycles than any before
    it, which happens in a solver's first solve and never after, as the cycle count of a
    captured solve is fixed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.parts = torch.zeros(0, dtype=torch.float64, device=device)
        self.norms = torch.zeros(0, dtype=torch.float64, device=device)

    def slot(self, index: int) -> Tensor:
        """The scalar that part `index` is written into."""
        if index >= len(self.parts):
            size = max(2 * len(self.parts), index + 1)
            parts = torch.zeros(size, dtype=torch.float64, device=self.device)
            parts[:len(self.parts)] = self.parts
            self.parts = parts
            self.norms = torch.zeros(size, dtype=torch.float64, device=self.device)
        return self.parts[index]


class DeviceHistory(History):
    """The norms of a solve of fixed cycle count, on the device. `norms` is a float64 view of
    the solver's static buffer (valid until its next solve), `initial` (relative tol_kind)
    a scalar of it; `converged` stays False, as nothing is compared on the host."""

    def __init__(self, residuals: Residuals, tol: float, relative: bool, factor: float,
                 drain: Callable[[], None]) -> None:
        super().__init__(residuals, tol, relative, factor, drain)
        if tol != 0.0:
            raise ValueError(f"a captured solve runs its max_iter cycles whatever the "
                             f"residuals are; tol={tol} would stop it at one read on the "
                             "host: use tol=0")
        if residuals.device_norms is None:
            residuals.device_norms = DeviceNorms(residuals.fine.u.device)
        self.buffers: DeviceNorms = residuals.device_norms
        self.count = 0

    def local(self) -> Tensor:
        """The latest cycle's part, written into the next entry of the static buffer."""
        slot = self.buffers.slot(self.count)
        self.residuals.local_into(slot)
        return slot

    def start(self, local: Tensor) -> None:
        self.count += 1

    def add(self, local: Tensor) -> None:
        self.count += 1

    def done(self) -> bool:
        return False

    def finish(self, like: Tensor, want_final: bool) -> Tensor | None:
        """Sum the parts over the ranks (one reduction, the messages' only host contact) and
        take their square roots into the static norms."""
        count = self.count
        parts = self.buffers.parts[:count]
        self.residuals.comm.allreduce_sum_(parts)
        norms = torch.sqrt(parts, out=self.buffers.norms[:count])
        if self.relative:
            self.initial, norms = norms[0], norms[1:]
        self.norms = norms
        return None


def check_norms(norms: Tensor, factor: float, what: str,
                where: str = "a captured training step") -> list[float]:
    """The norms read on the host; raises `DivergenceError` as the eager solve would have,
    at the first cycle whose residual is not finite or grew past `factor` times the first,
    with `what` (the pass) and `where` (what captured it) in a note. Returns them."""
    values = norms.tolist()
    try:
        check_divergence(values, factor, lambda: None)
    except Exception as err:
        err.add_note(f"in the {what} solve of {where}, read after it")
        raise
    return values
