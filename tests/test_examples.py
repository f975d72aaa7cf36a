"""The example scripts run and report what they promise."""

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def run(*args):
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_train_digits_example():
    out = run(EXAMPLES / "train_digits.py", "--epochs", "2")
    lines = out.splitlines()
    assert lines[0].startswith("epoch 1:") and "exported serial network" in lines[-1]
    assert lines[-1].split()[-1] == lines[-2].split("test accuracy ")[1].split(",")[0]


def test_heat_example_matches_sequential_stepping():
    out = run(EXAMPLES / "heat_parallel_in_time.py")
    diff = float(out.splitlines()[-1].split("= ")[1].split(";")[0])
    assert diff < 1e-9


def test_convergence_study_example(tmp_path):
    run(EXAMPLES / "convergence_study.py", tmp_path)
    assert (tmp_path / "convergence.png").stat().st_size > 10_000
    assert "| heat | FCF | 2 | 3 |" in (tmp_path / "convergence.md").read_text()
