"""Two ranks sharing one device against one rank: W2 and W2b training steps, float64 and
float32, with messages staged through the host and, where the MPI is CUDA-aware and the
states are on a GPU, sent from device memory. Every rank runs the workload alone
(comm=None) and across both ranks, from the same weights, and reports how far apart its
output, its gradients and both solves' residual histories are.

    mpiexec -n 2 python -m mpi4py gpu_two_ranks.py DEVICE WORKLOAD[,WORKLOAD...]
"""

import os
import sys
from pathlib import Path

import torch
from mpi4py import MPI
from torch import Tensor

sys.path.insert(0, str(Path(__file__).parent.parent.parent))  # benchmarks
from benchmarks.training import build  # noqa: E402
from benchmarks.workloads import TRAINING_WORKLOADS  # noqa: E402
from mgrit.app.launch import report  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
device = torch.device(sys.argv[1])
workloads = sys.argv[2].split(",")


def relative_error(actual: Tensor, expected: Tensor) -> float:
    diff = (actual.double() - expected.double()).abs().max()
    scale = expected.double().abs().max()
    return float(diff / scale) if scale > 0 else float(diff)


def history_error(a: dict, b: dict) -> float:
    """Largest relative difference of two residual histories (inf if their lengths
    differ)."""
    ra, rb = a["residuals"], b["residuals"]
    if len(ra) != len(rb):
        return float("inf")
    return max((abs(x - y) / max(abs(y), 1e-300) for x, y in zip(ra, rb)), default=0.0)


aware = bool(getattr(MPI, "Query_cuda_support", lambda: False)())
kinds = ["staged"] + (["cuda-aware"] if aware and device.type == "cuda" else [])
records = []
for messages in kinds:
    os.environ["MGRIT_CUDA_AWARE_MPI"] = "1" if messages == "cuda-aware" else "0"
    for name in workloads:
        work = TRAINING_WORKLOADS[name]()
        for dtype in (torch.float64, torch.float32):
            one, _ = build(work)
            both, _ = build(work, comm=world)
            out = {}
            for label, model in (("one", one), ("both", both)):
                model.to(device=device, dtype=dtype)
                x, y = work.inputs(torch.Generator().manual_seed(1))
                output = model(x.to(device=device, dtype=dtype))
                work.loss(output, y.to(device)).backward()
                out[label] = output.detach()
            lo, hi = both.layer_range
            pairs = [(p.grad, one.layers.params[k].grad[lo:hi + 1])
                     for k, p in both.layers.params.items()]
            for part in ("opening", "closing"):
                pairs += [(a.grad, b.grad) for a, b in
                          zip(getattr(both, part).parameters(), getattr(one, part).parameters())]
            records.append({
                "workload": name, "dtype": str(dtype), "messages": messages,
                "layers": [lo, hi], "device": str(out["both"].device),
                "gradients": len(pairs),
                "output_error": relative_error(out["both"], out["one"]),
                "gradient_error": max(relative_error(a, b) for a, b in pairs),
                "residual_error": max(history_error(both.stats[k], one.stats[k])
                                      for k in ("forward", "backward"))})
report({"records": records, "cuda_aware": aware})
