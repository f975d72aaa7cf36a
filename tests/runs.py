"""Running the `mgrit` command as a user does, in a subprocess (under mpiexec for several
ranks), and reading the metrics a run wrote."""

import json
import os
import subprocess
import sys

from conftest import mpiexec_path


def mgrit(*args, ranks=1, check=True, timeout=300):
    prefix = ([str(mpiexec_path()), "-n", str(ranks), sys.executable, "-m", "mpi4py"]
              if ranks > 1 else [sys.executable])
    proc = subprocess.run(prefix + ["-m", "mgrit", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if check and proc.returncode != 0:
        raise AssertionError(f"mgrit {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def all_records(folder):
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line]


def records(folder):
    """What the run measured: every record but the launches' (which say where each launch
    ran, and differ between a resumed run and an uninterrupted one)."""
    return [r for r in all_records(folder) if r["type"] != "launch"]


def launches(folder):
    return [r for r in all_records(folder) if r["type"] == "launch"]
