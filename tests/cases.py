"""Problems shared by the in-process tests and the MPI scripts."""

import torch

from mgrit.problems import Dahlquist, DenseResNet, Heat1D

from needs import require


def heat_problem(nx: int = 33, a: float = 1.0) -> tuple[Heat1D, torch.Tensor]:
    """u_t = a u_xx + b on [0, 1] with exact solution sin(pi x) cos(t) (its steps need
    SciPy, an optional dependency)."""
    require("scipy", "the heat equation's tridiagonal solves")
    prop = Heat1D.sine_solution(nx, a=a)
    return prop, prop.initial_sine()


def resnet_problem(num_steps: int = 64, width: int = 4, seed: int = 1,
                   dtype: torch.dtype = torch.float64) -> tuple[DenseResNet, torch.Tensor]:
    prop = DenseResNet.random(num_steps, width, seed=seed, dtype=dtype)
    u0 = torch.randn(3, width, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return prop, u0


def dahlquist_problem(lam: complex = -1.0, dtype: torch.dtype = torch.float64):
    return Dahlquist(lam), torch.tensor([1.0, 0.5], dtype=dtype)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))
