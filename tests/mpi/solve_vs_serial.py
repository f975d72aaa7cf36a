"""Every rank solves many problems distributed and serially and compares the two.

Each rank reports the number of cases and any mismatch.
"""

import itertools
import sys
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).parent.parent))  # cases.py, nets.py
import mgrit  # noqa: E402
from mgrit.app.launch import report  # noqa: E402
from cases import dahlquist_problem, heat_problem, resnet_problem  # noqa: E402

torch.set_num_threads(1)
comm = MPI.COMM_WORLD


def problems():
    yield "dahlquist", dahlquist_problem(-1.0), 4.0, 1e-12
    yield "dahlquist-complex", dahlquist_problem(-0.2 + 1.5j, torch.complex128), 4.0, 1e-12
    yield "heat", heat_problem(17), 1.0, 1e-12
    yield "heat-float32", (heat_problem(17)[0], heat_problem(17)[1].float()), 1.0, 1e-6
    yield "resnet", resnet_problem(num_steps=100), 1.0, 1e-12
    yield "resnet-float32", resnet_problem(num_steps=100, dtype=torch.float32), 1.0, 1e-6


SETTINGS = [
    # (levels, coarsening, relax, cycle, guess, c_weight, execution)
    (2, 2, "F", "V", "zero", 1.0, "auto"),
    (2, 4, "FCF", "V", "nested", 1.0, "loop"),
    (3, 2, "FCF", "F", "zero", 0.7, "auto"),
    (3, 3, "F", "F", "nested", 1.0, "auto"),
    (4, 2, "FCF", "V", "nested", 1.3, "loop"),
    (4, [4, 2, 2], ["F", "FCF", "FCF"], "V", "zero", 1.0, "auto"),
    (5, 2, "FCF", "F", "zero", 1.0, "auto"),
    (5, 2, "F", "V", "tensor", 1.0, "auto"),
]
STEPS = [61, 64, 37, 5, 600]


def compare(name, prop, u0, t1, n, setting, tol):
    levels, m, relax, cycle, guess, w, execution = setting
    if guess == "tensor":
        g = torch.Generator().manual_seed(n)
        guess = torch.randn((n + 1, *u0.shape), generator=g, dtype=torch.float64).to(u0.dtype)
    cfg = mgrit.Config(levels=levels, coarsening=m, relax=relax, cycle=cycle,
                       initial_guess=guess, c_weight=w, tol=0.0, max_iter=4, min_coarse=1,
                       execution=execution)
    serial = mgrit.solve(prop, u0, n, 0.0, t1, cfg)
    dist = mgrit.solve(prop, u0, n, 0.0, t1, cfg, comm=comm)
    problems = []
    if dist.levels != serial.levels or len(dist.residuals) != len(serial.residuals):
        problems.append(f"levels/iterations {dist.levels}/{dist.iterations} vs "
                        f"{serial.levels}/{serial.iterations}")
    for k, (a, b) in enumerate(zip(dist.residuals, serial.residuals)):
        if abs(a - b) > tol * abs(b):
            problems.append(f"residual {k}: {a!r} vs {b!r}")
    mine = serial.states[dist.first_index: dist.first_index + len(dist.states)]
    if dist.states.dtype != u0.dtype or dist.final.dtype != u0.dtype:
        problems.append(f"dtype changed to {dist.states.dtype}")
    elif len(dist.states) and (dist.states - mine).abs().max() > tol * mine.abs().max():
        problems.append(f"states differ by {(dist.states - mine).abs().max().item():.2e}")
    if (dist.final - serial.final).abs().max() > tol * serial.final.abs().max():
        problems.append("final state differs")
    return [f"{name} N={n} {setting}: {p}" for p in problems]


failures, cases = [], 0
for (name, (prop, u0), t1, tol), n, setting in itertools.product(problems(), STEPS, SETTINGS):
    # the long run's deep hierarchies are the scalar problems' to check: a heat or ResNet
    # state costs a matrix product a step and adds nothing there the short runs miss
    if not name.startswith("dahlquist") and n > 100:
        continue
    failures += compare(name, prop, u0, t1, n, setting, tol)
    cases += 1

# tol = 0 reduces the residual norms once, after the last cycle; any tol > 0 after every
# cycle: the same cycles, so the same residual history and states
for name, (prop, u0), t1, _ in problems():
    runs = [mgrit.solve(prop, u0, 64, 0.0, t1, mgrit.Config(levels=3, coarsening=2, tol=tol,
                                                            max_iter=3), comm=comm)
            for tol in (0.0, 1e-300)]
    if runs[0].residuals != runs[1].residuals or not torch.equal(runs[0].states, runs[1].states):
        failures.append(f"{name}: tol=0 {runs[0].residuals} vs tol=1e-300 {runs[1].residuals}")

report({"size": comm.size, "cases": cases, "failures": failures[:20]})
