"""The 1D heat equation u_t = a u_xx + b(x, t) with homogeneous Dirichlet boundaries."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from ..core.propagator import Step, StepBatch

Forcing = Callable[[Tensor, Tensor], Tensor]


def _lapack(dtype: np.dtype) -> tuple:
    """LAPACK's tridiagonal factorisation and solve (?pttrf, ?pttrs) from SciPy, which only
    this problem needs: an optional dependency (the `app` extra), imported at first use."""
    try:
        from scipy.linalg import get_lapack_funcs
    except ImportError:
        raise ImportError("mgrit.problems.Heat1D solves its tridiagonal systems with SciPy: "
                          "pip install scipy (or mgrit[app])") from None
    return get_lapack_funcs(("pttrf", "pttrs"), dtype=dtype)


class Heat1D:
    """Backward Euler in time, second-order central differences in space.

    The state holds the nx - 2 interior points of an nx-point grid on [x0, x1].
    One step solves (I + dt*a*L) u_new = u + dt*b(x, t + dt), L the negative
    discrete Laplacian, with a tridiagonal LDL^T factorisation cached per dt.
    `forcing(x, t)` must broadcast: it is called with x of shape (1, n) and a
    column t of shape (B, 1) of end times (float64), and returns b there.
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

    @classmethod
    def sine_solution(cls, nx: int, a: float = 1.0) -> "Heat1D":
        """The problem on [0, 1] whose exact solution is u(x, t) = sin(pi x) cos(t):
        forcing b = -sin(pi x) (sin t - a pi^2 cos t); start from `initial_sine()`."""
        prop = cls(nx, a=a)
        spatial = torch.sin(math.pi * prop.x)
        prop.forcing = lambda x, t: -spatial * (torch.sin(t) - a * math.pi ** 2 * torch.cos(t))
        return prop

    def initial_sine(self, dtype: torch.dtype = torch.float64) -> Tensor:
        return torch.sin(math.pi * self.x).to(dtype)

    def exact_sine(self, t: float) -> Tensor:
        """sin(pi x) cos(t) on the interior points."""
        return torch.sin(math.pi * self.x) * math.cos(t)

    def initial(self, f: Callable[[Tensor], Tensor], dtype: torch.dtype = torch.float64) -> Tensor:
        """The state u(x, t0) = f(x) on the interior points."""
        return f(self.x).to(dtype)

    def _factor(self, dt: float, dtype: np.dtype) -> tuple:
        """LDL^T factors of the symmetric positive definite I + dt*a*L, cached per dt."""
        key = (dt, dtype)
        if key not in self._factors:
            n = self.nx - 2
            fac = dt * self.a / self.dx ** 2
            pttrf, pttrs = _lapack(dtype)
            real = np.float32 if dtype in (np.float32, np.complex64) else np.float64
            d, e, info = pttrf(np.full(n, 1.0 + 2.0 * fac, dtype=real),
                               np.full(n - 1, -fac, dtype=dtype))
            if info != 0:
                raise RuntimeError(f"tridiagonal factorisation failed (LAPACK info {info})")
            self._factors[key] = (pttrs, d, e)
        return self._factors[key]

    def _advance(self, states: Tensor, dt: float, t_end: "Tensor | None") -> Tensor:
        """Backward Euler for the rows of `states` (shape (B, n)), t_end the rows' end times.

        Rows go through in blocks of about 512 KiB, so forcing, right-hand side and the
        two triangular sweeps of a block run in cache rather than streaming the whole
        batch through memory once per operation.
        """
        out = torch.empty(states.shape, dtype=states.dtype)
        pttrs, d, e = self._factor(dt, out.numpy().dtype)
        rows = max(1, (1 << 19) // max(out[0].numel() * out.element_size(), 1))
        src = states.detach().cpu()
        for first in range(0, len(out), rows):
            block = out[first: first + rows]
            if self.forcing is None:
                block.copy_(src[first: first + rows])
            else:
                b = self.forcing(self.x[None, :], t_end[first: first + rows, None])
                torch.add(src[first: first + rows], b.to(out.dtype), alpha=dt, out=block)
            _, info = pttrs(d, e, block.numpy().T, overwrite_b=1)
            if info != 0:
                raise RuntimeError(f"tridiagonal solve failed (LAPACK info {info})")
        return out.to(states.device)

    def step(self, u: Tensor, s: Step) -> Tensor:
        t_end = torch.tensor([s.t + s.dt], dtype=torch.float64)
        return self._advance(u[None, :], s.dt, t_end)[0]

    def step_batch(self, states: Tensor, steps: StepBatch) -> Tensor:
        return self._advance(states, steps.dt, steps.t + steps.dt)
