"""The example scripts run and report what they promise."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import mpiexec_path

EXAMPLES = Path(__file__).parent.parent / "examples"


def run(*args, ranks=1):
    prefix = ([mpiexec_path(), "-n", str(ranks), sys.executable, "-m", "mpi4py"]
              if ranks > 1 else [sys.executable])
    proc = subprocess.run([*prefix, *map(str, args)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_train_digits_example():
    out = run(EXAMPLES / "train_digits.py", "--epochs", "2")
    lines = out.splitlines()
    assert lines[0].startswith("epoch 1:") and "exported serial network" in lines[-1]
    assert lines[-1].split()[-1] == lines[-2].split("test accuracy ")[1].split(",")[0]


@pytest.mark.slow
def test_train_digits_example_chooses_its_solvers():
    out = run(EXAMPLES / "train_digits.py", "--epochs", "1", "--choose", ranks=2)
    lines = out.splitlines()
    assert lines[0].startswith("chosen: forward levels=") and lines[1].startswith("epoch 1:")
    assert "exported serial network" in lines[-1]


@pytest.mark.slow
def test_heat_example_matches_sequential_stepping():
    out = run(EXAMPLES / "heat_parallel_in_time.py")
    diff = float(out.splitlines()[-1].split("= ")[1].split(";")[0])
    assert diff < 1e-9


@pytest.mark.slow
def test_convergence_study_example(tmp_path):
    run(EXAMPLES / "convergence_study.py", tmp_path)
    assert (tmp_path / "convergence.png").stat().st_size > 10_000
    assert "| heat | FCF | 2 | 3 |" in (tmp_path / "convergence.md").read_text()


# a tiny model: 4 blocks, 2 levels, 3 steps with the validation loss after steps 2 and 3
TINY_LM = ["--steps", "3", "--width", "16", "--heads", "2", "--blocks", "4", "--levels", "2",
           "--context", "16", "--window", "8", "--batch", "8", "--every", "2",
           "--validation", "32", "--sample", "20"]


def lm_report(out):
    """(losses, validation losses, sample line) of transformer_lm.py's output."""
    lines = out.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == ["step 1", "step 2", "step 3"]
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in steps]
    validation = [float(line.split("validation loss ")[1]) for line in steps
                  if "validation" in line]
    assert len(validation) == 2 and all(math.isfinite(v) for v in losses + validation)
    assert lines[-1].startswith("sample after ")
    return losses, validation, lines[-1]


@pytest.mark.mpi
def test_transformer_language_model_example_on_one_process_and_two_ranks():
    one = lm_report(run(EXAMPLES / "transformer_lm.py", *TINY_LM))
    two = lm_report(run(EXAMPLES / "transformer_lm.py", *TINY_LM, ranks=2))
    assert two[0] == pytest.approx(one[0], rel=1e-3)
    assert two[1] == pytest.approx(one[1], rel=1e-3)
