"""Layer-parallel training against serial autograd on the equivalent plain network.

Each rank compares what it holds (its layers, the replicated opening and closing, the
output and the input gradient) with a serial network it builds and runs itself.
"""

import sys
from pathlib import Path

import torch
from mpi4py import MPI
from torch import nn

sys.path.insert(0, str(Path(__file__).parent.parent))  # cases.py, nets.py
import mgrit  # noqa: E402
from mgrit.app.launch import report  # noqa: E402
from nets import (INEXACT_CASES, build, cosine, data, float32_errors,  # noqa: E402
                  inexact_training, owned_pairs, relative)

torch.set_num_threads(1)
world = MPI.COMM_WORLD
mode = sys.argv[1]
results = {}


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y)


def one_pass(model, serial, x, y):
    xa = x.clone().requires_grad_()
    xb = x.clone().requires_grad_()
    out = model(xa)
    loss_fn(out, y).backward()
    ref = serial(xb)
    loss_fn(ref, y).backward()
    out, ref = out.detach(), ref.detach()
    pairs = owned_pairs(model, serial, grad=True)
    return {"output": float((out - ref).norm() / ref.norm()),
            "input_grad": float((xa.grad - xb.grad).norm() / xb.grad.norm()),
            "param_grads": relative(pairs),
            "cosine": cosine(pairs)}


def train(model, serial, x, y, steps):
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        for opt, net in ((opt_a, model), (opt_b, serial)):
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()
    return relative(owned_pairs(model, serial))


EXACT = mgrit.Config(levels=1)
CONVERGED = mgrit.Config(levels=3, coarsening=2, relax="FCF", tol=1e-13, max_iter=60,
                         min_coarse=1)
INEXACT_F = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=2,
                         min_coarse=1)
INEXACT_B = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=1,
                         min_coarse=1)

# float32 stops converging at its round-off: a fixed number of cycles well past that point
FLOAT32_CONVERGED = mgrit.Config(levels=3, coarsening=2, relax="FCF", tol=0.0, max_iter=12,
                                 min_coarse=1)

if mode == "agreement":
    for kind, n in (("dense", 13), ("dense", 16), ("conv", 7)):
        x, y = data(kind, 4)
        for label, fwd, bwd in (("exact", EXACT, EXACT), ("converged", CONVERGED, CONVERGED)):
            if n < 8 and label != "exact":
                continue
            model, serial = build(kind, n, fwd, bwd, comm=world)
            results[f"{kind}-{n}-{label}"] = one_pass(model, serial, x, y)
        model, serial = build(kind, n, EXACT, EXACT, comm=world)
        results[f"{kind}-{n}-train2"] = {"params": train(model, serial, x, y, 2)}
elif mode == "inexact":
    # the same inexact training on these ranks as in one process (the test compares)
    for kind, n, levels, warm, steps in INEXACT_CASES:
        results[f"{kind}-{n}-{levels}-{warm}"] = inexact_training(kind, n, levels, warm,
                                                                  steps, comm=world)
elif mode == "float32":
    for kind, n in (("dense", 13), ("conv", 9), ("gelu", 13)):
        for label, config in (("exact", EXACT), ("converged", FLOAT32_CONVERGED)):
            results[f"{kind}-{label}"] = float32_errors(kind, n, config, comm=world)
elif mode == "converted":
    # trained a step in float64 (ghost layers sent in float64), then converted: the
    # ghost layers' messages are made again for float32
    x, y = data("dense", 4)
    model, serial = build("dense", 16, FLOAT32_CONVERGED, FLOAT32_CONVERGED, comm=world)
    results["float64"] = {"params": train(model, serial, x, y, 1)}
    model.float()
    serial.float()
    results["float32"] = one_pass(model, serial, x.float(), y)
elif mode == "inexact-data-parallel":
    layer_comm, data_comm = mgrit.split_world(world, 2)
    results["dense"] = inexact_training("dense", 13, 3, True, 3, comm=layer_comm,
                                        data_comm=data_comm)
    results["data_rank"] = data_comm.Get_rank()
elif mode == "data-parallel":
    layer_comm, data_comm = mgrit.split_world(world, 2)
    x, y = data("dense", 8)
    half = slice(4 * data_comm.Get_rank(), 4 * data_comm.Get_rank() + 4)
    model, serial = build("dense", 13, EXACT, EXACT, comm=layer_comm, data_comm=data_comm)
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        opt_a.zero_grad()
        loss_fn(model(x[half]), y[half]).backward()
        opt_a.step()
        opt_b.zero_grad()
        loss_fn(serial(x), y).backward()
        opt_b.step()
    results["2x2"] = {"params": relative(owned_pairs(model, serial)),
                      "layer_rank": layer_comm.Get_rank(), "data_rank": data_comm.Get_rank()}
elif mode == "export":
    x, y = data("conv", 4)
    model, _ = build("conv", 9, INEXACT_F, INEXACT_B, comm=world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    exact, _ = build("conv", 9, EXACT, EXACT, comm=world)
    exact.load_state_dict(model.state_dict())
    with torch.no_grad():
        out = exact(x)
    plain = model.to_serial()
    model.eval()                 # the default inference options: exact sequential stepping
    with torch.no_grad():
        evaluated = model(x)
    model.train()
    evaluation = {"eval_difference": float((evaluated - out).norm() / out.norm()),
                  "eval_cycles": model.stats["forward"]["iterations"]}
    if world.rank == 0:
        with torch.no_grad():
            results["export"] = {"difference": float((plain(x) - out).norm() / out.norm()),
                                 "layers": len(plain) - 2, **evaluation}
    else:
        results["export"] = {"is_none": plain is None, **evaluation}

elif mode == "checkpoint":
    folder = Path(sys.argv[2])
    fwd = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=2,
                       min_coarse=1, initial_guess="warm")
    bwd = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=1,
                       min_coarse=1, initial_guess="warm")
    x, y = data("dense", 4)

    def run(model, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

    model, _ = build("dense", 16, fwd, bwd, comm=world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    run(model, opt, 2)
    model.save_checkpoint(folder, opt, step=2)
    run(model, opt, 2)
    uninterrupted = [p.detach().clone() for p in model.parameters()]
    resumed, _ = build("dense", 16, fwd, bwd, comm=world, seed=99)
    opt = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    extra = resumed.load_checkpoint(folder, opt)
    run(resumed, opt, 2)
    results["resume"] = {
        "difference": max(float((a.detach() - b).abs().max())
                          for a, b in zip(resumed.parameters(), uninterrupted)),
        "extra": extra, "files": sorted(p.name for p in folder.iterdir())}
    other, _ = build("dense", 15, fwd, bwd, comm=world)
    try:
        other.load_checkpoint(folder)
        results["refused"] = None
    except ValueError as err:
        results["refused"] = str(err)
elif mode == "bad-batch":
    x, y = data("dense", 4 if world.rank != 1 else 3)
    model, _ = build("dense", 16, comm=world)
    try:
        model(x)
        results["error"] = None
    except ValueError as err:
        results["error"] = str(err)

report({"size": world.size, "results": results})
