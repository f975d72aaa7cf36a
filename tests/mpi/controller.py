"""The controller on several ranks: exact training once it decides exact stepping, and the
same decisions on every rank.

exact:      dense N = 13, float64, a policy that chooses exact stepping at its first probe;
            after that step rank 0 exports the network and trains the plain copy serially
            beside the layer-parallel model; at the end it compares the two.
collective: dense N = 24, T = 6, the default policy with a low threshold; every rank reports
            its decisions, probes and costs.
calibrated: dense N = 64; every rank calibrates the cost model, chooses a hierarchy and
            prices settings, and reports them.
"""

import sys
from pathlib import Path

import torch
from mpi4py import MPI
from torch import nn

sys.path.insert(0, str(Path(__file__).parent.parent))  # nets.py
import mgrit  # noqa: E402
from mgrit.app.launch import report  # noqa: E402
from mgrit.nn import Controller, Policy, Setting  # noqa: E402
from mgrit.nn.controller import EXACT_SETTING  # noqa: E402
from nets import build, data  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
mode = sys.argv[1]

INEXACT_F = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=2,
                         min_coarse=1)
INEXACT_B = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=1,
                         min_coarse=1)


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y)


class ExactAtOnce(Policy):
    """Measures nothing else and chooses exact stepping at the first probe."""

    def wanted(self, error):
        return []

    def decide(self, step, error, candidates, indicator=None):
        self.last_probe = step
        self.setting = EXACT_SETTING
        return EXACT_SETTING, "forced"


def batches(count):
    return [data("dense", 6, seed=10 + k) for k in range(count)]


if mode == "exact":
    model, _ = build("dense", 13, INEXACT_F, INEXACT_B, comm=world)
    controller = Controller(model, policy=ExactAtOnce(Setting(2, 1, 3), lambda s: 1.0,
                                                               every=2, max_every=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    serial = serial_opt = None
    for k, (x, y) in enumerate(batches(6)):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        controller.after_backward(lambda: loss_fn(model(x), y))
        opt.step()
        if k == 0:
            serial = model.to_serial()
            if serial is not None:
                serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1)
        elif serial is not None:
            serial_opt.zero_grad()
            loss_fn(serial(x), y).backward()
            serial_opt.step()
    final = model.to_serial()
    out = {"setting": controller.setting.label, "decisions": controller.decisions}
    if final is not None:
        num = den = 0.0
        for a, b in zip(final.parameters(), serial.parameters()):
            num += float((a - b).pow(2).sum())
            den += float(b.pow(2).sum())
        out["parameters"] = (num / den) ** 0.5
    report(out)
elif mode == "collective":
    torch.manual_seed(2)
    opening, closing = nn.Linear(5, 8), nn.Linear(8, 3)
    model = mgrit.LayerParallel(lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh()), 24, 6.0,
                                INEXACT_F, INEXACT_B, comm=world, opening=opening,
                                closing=closing).double()
    controller = Controller(model, threshold=0.05, every=2, max_every=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for k, (x, y) in enumerate(batches(16)):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        controller.after_backward(lambda: loss_fn(model(x), y))
        opt.step()
        if k % 4 == 3:
            controller.validation(1.0 + world.Get_rank())   # different on every rank
    report({"setting": controller.setting.label, "decisions": controller.decisions,
            "probes": [{key: p[key] for key in ("step", "setting", "error", "candidates")}
                       for p in controller.probes],
            "costs": {s.label: c for s, c in controller.policy._costs.items()}})
elif mode == "calibrated":
    from mgrit.nn import calibrate, choose_settings  # noqa: E402
    from mgrit.nn.defaults import training_config  # noqa: E402
    model, _ = build("dense", 64, training_config("forward", 3, 4),
                     training_config("backward", 3, 4), comm=world)
    x, y = data("dense", 8)
    loss_fn(model(x), y).backward()
    cal = calibrate(model, x, repeats=2)
    chosen = choose_settings(model, x, calibration=cal)
    measured = choose_settings(model, x, calibration=cal, threshold=0.25)
    controller = Controller(model, calibration=cal)
    settings = [controller.base, Setting(1, 1, 2, coarsening=8), EXACT_SETTING]
    report({"calibration": cal.as_dict(),
            "chosen": [sorted(c.describe().items()) for c in chosen],
            "measured": [sorted(c.describe().items()) for c in measured],
            "costs": [controller.cost(s) for s in settings]})
