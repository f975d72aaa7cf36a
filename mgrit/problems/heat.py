"""The 1D heat equation u_t = a u_xx + b(x, t) with homogeneous Dirichlet boundaries."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from scipy.linalg import get_lapack_funcs
from torch import Tensor

from ..propagator import Step, StepBatch

Forcing = Callable[[Tensor, "float | Tensor"], Tensor]


class Heat1D:
    """Backward Euler in time, second-order central differences in space.

    The state holds the nx - 2 interior points of an nx-point grid on [x0, x1].
    One step solves (I + dt*a*L) u_new = u + dt*b(x, t + dt), L the negative
    discrete Laplacian, with a tridiagonal LU factorisation cached per dt.
    `forcing(x, t)` must broadcast: x has shape (n,) or (1, n) and t is a float
    or a column (B, 1) of end times; it returns b at those points and times.
    """

    def __init__(self, nx: int, a: float = 1.0, x0: float = 0.0, x1: float = 1.0,
                 forcing: Forcing | None = None) -> None:
        if isinstance(nx, bool) or not isinstance(nx, int) or nx < 3:
            raise ValueError(f"nx must be an int >= 3 (two boundary points and an interior), got {nx!r}")
        if not a > 0:
            raise ValueError(f"the diffusion coefficient a must be > 0, got {a!r}")
        if not x1 > x0:
            raise ValueError(f"need x0 < x1, got [{x0}, {x1}]")
        self.nx = nx
        self.a = float(a)
        self.x = torch.linspace(x0, x1, nx, dtype=torch.float64)[1:-1]
        self.dx = (x1 - x0) / (nx - 1)
        self.forcing = forcing
        self._factors: dict[tuple[float, np.dtype], tuple] = {}

    def initial(self, f: Callable[[Tensor], Tensor], dtype: torch.dtype = torch.float64) -> Tensor:
        """The state u(x, t0) = f(x) on the interior points."""
        return f(self.x).to(dtype)

    def _factor(self, dt: float, dtype: np.dtype) -> tuple:
        key = (dt, dtype)
        if key not in self._factors:
            n = self.nx - 2
            fac = dt * self.a / self.dx ** 2
            gttrf, gttrs = get_lapack_funcs(("gttrf", "gttrs"), dtype=dtype)
            off = np.full(n - 1, -fac, dtype=dtype)
            diag = np.full(n, 1.0 + 2.0 * fac, dtype=dtype)
            dl, d, du, du2, ipiv, info = gttrf(off, diag, off.copy())
            if info != 0:
                raise RuntimeError(f"tridiagonal factorisation failed (LAPACK info {info})")
            self._factors[key] = (gttrs, dl, d, du, du2, ipiv)
        return self._factors[key]

    def _solve(self, rhs: Tensor, dt: float) -> Tensor:
        """Solve (I + dt*a*L) X = rhs for the rows of rhs (shape (B, n))."""
        b = rhs.detach().cpu().numpy()
        gttrs, dl, d, du, du2, ipiv = self._factor(dt, b.dtype)
        x, info = gttrs(dl, d, du, du2, ipiv, b.T)
        if info != 0:
            raise RuntimeError(f"tridiagonal solve failed (LAPACK info {info})")
        return torch.from_numpy(np.ascontiguousarray(x.T)).to(rhs.device)

    def _rhs(self, u: Tensor, dt: float, t_end: "float | Tensor") -> Tensor:
        if self.forcing is None:
            return u
        b = self.forcing(self.x if isinstance(t_end, float) else self.x[None, :], t_end)
        return u + dt * b.to(u.dtype)

    def step(self, u: Tensor, s: Step) -> Tensor:
        return self._solve(self._rhs(u, s.dt, s.t + s.dt)[None, :], s.dt)[0]

    def step_batch(self, states: Tensor, steps: StepBatch) -> Tensor:
        t_end = (steps.t + steps.dt)[:, None] if self.forcing is not None else 0.0
        return self._solve(self._rhs(states, steps.dt, t_end), steps.dt)
