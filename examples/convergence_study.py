"""Residual against cycle for F/FCF relaxation, coarsening 2/4/8 and 2-5 levels on Dahlquist
and the heat equation (add a trained network with mgrit compare --solver-study).

    python examples/convergence_study.py out/study
"""

import sys
from pathlib import Path

import torch

from mgrit.app.compare import solver_study

torch.set_num_threads(1)
solver_study(Path(sys.argv[1] if len(sys.argv) > 1 else "out/study"), cycles=10)
