"""Layer-parallel networks with context inputs and dropout against the plain network,
trained side by side on every rank (see tests/transformer_cases.py)."""

import sys
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).parent.parent))  # transformer_cases.py
import mgrit  # noqa: E402
from mgrit.app.launch import report  # noqa: E402
from transformer_cases import build, inputs, train_side_by_side  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
mode = sys.argv[1]
results = {}

EXACT = mgrit.Config(levels=1)
CONVERGED = mgrit.Config(levels=3, coarsening=2, relax="FCF", tol=1e-13, max_iter=60,
                         min_coarse=1)

if mode == "train":
    for case in sys.argv[2].split(","):
        for name, config in (("exact", EXACT), ("converged", CONVERGED)):
            results[f"{case}-{name}"] = train_side_by_side(case, 7, config, comm=world)
elif mode == "replicas":
    # one layer rank, two replicas, the same batch on both: replicas must not share masks
    layer_comm, data_comm = mgrit.split_world(world, 1)
    torch.manual_seed(1)
    model = mgrit.LayerParallel(lambda: mgrit.nn.TransformerBlock(8, 2, dropout=0.5), 4,
                                forward=EXACT, backward=EXACT, comm=layer_comm,
                                data_comm=data_comm, seed=11).double()
    torch.manual_seed(1)
    alone = mgrit.LayerParallel(lambda: mgrit.nn.TransformerBlock(8, 2, dropout=0.5), 4,
                                forward=EXACT, backward=EXACT, seed=11).double()
    x = torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(x)
        one = alone(x)
    outs = world.allgather(out)
    results["replicas_differ"] = bool((outs[0] - outs[1]).abs().max() > 1e-6)
    results["equals_one_process"] = bool(torch.equal(out, one))
    results["replica"] = data_comm.Get_rank()
elif mode == "bad-context":
    # rank 1's mask covers one token fewer: every rank must refuse before any exchange
    model, _ = build("block", 7, EXACT, comm=world)
    x, _, context = inputs("block")
    if world.rank == 1:
        context = {"attn_mask": context["attn_mask"][:, :-1, :-1]}
    try:
        model(x, **context)
        results["error"] = None
    except ValueError as err:
        results["error"] = str(err)

report({"size": world.size, "results": results})
