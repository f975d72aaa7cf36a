"""What a test needs beyond the library: optional packages and an MPI launcher.

Without them a test is skipped, so that the library's own tests run in an environment with
only torch, numpy and mpi4py. `make test` sets MGRIT_TEST_REQUIRE_ALL=1, under which a
missing one fails the test instead: a broken install must not turn tests into skips."""

import importlib
import os
from types import ModuleType

import pytest
import torch


def missing(reason: str) -> None:
    """Skip the running test for `reason`, or fail it under MGRIT_TEST_REQUIRE_ALL=1."""
    if os.environ.get("MGRIT_TEST_REQUIRE_ALL") == "1":
        pytest.fail(f"{reason}; make test installs everything the tests need")
    pytest.skip(reason)


def require(module: str, what: str) -> ModuleType:
    """The optional package `module` that `what` needs, or `missing`."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        missing(f"{what} needs {module} ({err})")


def cuda_device() -> torch.device:
    """The CUDA device a `gpu`-marked test runs on. Without one the test is skipped, also
    under MGRIT_TEST_REQUIRE_ALL=1: a machine without a GPU is a complete install. Only
    MGRIT_TEST_REQUIRE_GPU=1 (set by benchmarks/gpu_check.sh on a GPU machine) fails it:
    there a GPU test that skips would hide a broken CUDA set-up."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    reason = (f"needs a CUDA device; torch {torch.__version__} sees none (CUDA build: "
              f"{torch.version.cuda})")
    if os.environ.get("MGRIT_TEST_REQUIRE_GPU") == "1":
        pytest.fail(f"{reason}, and MGRIT_TEST_REQUIRE_GPU=1 asks for one")
    pytest.skip(reason)
