"""The captured training step on several ranks against the eager step on the same ranks:
losses, this rank's parameters and both passes' residual histories after SGD-momentum and
Adam steps, bit for bit, with the steps after the first run under the host-read guard (the
messages between ranks are the communicator's reads, which it lets through)."""

import sys
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).parent.parent))  # nets.py
import mgrit  # noqa: E402
from mgrit.app.launch import report  # noqa: E402
from nets import build, data, loss_fn, optimizer  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
FORWARD = mgrit.Config(levels=3, coarsening=2, tol=0.0, max_iter=2, min_coarse=1)
BACKWARD = mgrit.Config(levels=3, coarsening=2, tol=0.0, max_iter=1, min_coarse=1,
                        initial_guess="warm")
STEPS = 4


results = {}
for name in ("sgd", "adam"):
    runs = {}
    for captured in (False, True):
        # 7 layers: the ranks' shares differ in size on 2 and 3 ranks
        model, _ = build("dense", 7, FORWARD, BACKWARD, comm=world)
        opt = optimizer(name, model)
        step = (mgrit.nn.CapturedStep(model, loss_fn, opt, *data("dense", 4), check=False)
                if captured else None)
        losses, histories, guarded = [], [], 0
        for k in range(STEPS):
            x, y = data("dense", 4, seed=k)
            if captured:
                if k == 0:
                    loss = step.step(x, y)
                else:
                    with step.guarded():
                        loss = step.step(x, y)
                    guarded += 1
                step.check()
                histories.append(step.stats())
            else:
                opt.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                histories.append({p: {"residuals": model.stats[p]["residuals"],
                                      "iterations": model.stats[p]["iterations"]}
                                  for p in ("forward", "backward")})
            losses.append(loss.item())
        runs[captured] = (losses, [p.detach().clone() for p in model.parameters()],
                          histories, guarded)
    (la, pa, ha, _), (lb, pb, hb, guarded) = runs[False], runs[True]
    results[name] = {"losses": la == lb, "histories": ha == hb, "guarded": guarded,
                     "params": all(torch.equal(a, b) for a, b in zip(pa, pb)),
                     "cycles": [h["forward"]["iterations"] for h in hb],
                     "moved": max(float((a - b).abs().max()) for a, b in
                                  zip(pb, build("dense", 7, FORWARD, BACKWARD,
                                                 comm=world)[0].parameters()))}
# with the controller: its probes after each captured step are collective, and every rank
# measures and decides alike
model, _ = build("dense", 7, FORWARD, BACKWARD, comm=world)
units = mgrit.nn.controller.Units(1e-5, 1e-7, 1e-6)
controller = mgrit.nn.Controller(model, calibration=mgrit.nn.controller.Calibration(units, units),
                                 every=2, max_every=2)
step = mgrit.nn.CapturedStep(model, loss_fn, optimizer("sgd", model), *data("dense", 4),
                             controller=controller)
for k in range(STEPS):
    step.step(*data("dense", 4, seed=k))
control = {"probes": [[p["step"], p["setting"], p["error"]] for p in controller.probes],
           "decisions": [[d["step"], d["from"], d["to"]] for d in controller.decisions],
           "setting": controller.setting.label}
report({"size": world.size, "results": results, "control": control})
