import math

import pytest
import torch

import mgrit
from mgrit.problems import Heat1D


def heat_problem(nx: int = 33, a: float = 1.0) -> tuple[Heat1D, torch.Tensor]:
    """u_t = a u_xx + b on [0, 1] with exact solution sin(pi x) cos(t)."""

    def forcing(x, t):
        t = torch.as_tensor(t, dtype=torch.float64)
        return -torch.sin(math.pi * x) * (torch.sin(t) - a * math.pi ** 2 * torch.cos(t))

    prop = Heat1D(nx, a=a, forcing=forcing)
    return prop, prop.initial(lambda x: torch.sin(math.pi * x))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def config():
    return mgrit.Config
