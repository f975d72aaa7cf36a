"""Every rank splits a few training steps of W2 (the nested setting, with the fine
boundaries) with `benchmarks.studies.fixed` and reports what it measured; rank 0 also
reports the table of every rank."""

import sys
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).parent.parent.parent))  # the benchmarks package
from benchmarks.studies import fixed  # noqa: E402
from mgrit.app.launch import report  # noqa: E402

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
result = fixed.measure(layers=64, steps=3, warmup=1, nested=True, fine=True, comm=comm)
out = {"ranks": result["ranks"], "spans": result["spans"], "step": result["step"]}
if comm.Get_rank() == 0:
    out["table"] = fixed.table(result)
    out["columns"] = len(result["ranks_spans"])
report(out)
