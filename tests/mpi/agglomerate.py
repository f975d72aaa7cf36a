"""Every rank solves problems with and without `Config.agglomerate` over MPI, and serially,
and reports any residual or state that differs by more than round-off."""

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

PROBLEMS = [("dahlquist", dahlquist_problem(-1.0), 4.0),
            ("dahlquist-complex", dahlquist_problem(-0.2 + 1.5j, torch.complex128), 4.0),
            ("heat", heat_problem(17), 1.0), ("resnet", resnet_problem(num_steps=64), 1.0)]
SETTINGS = [  # (levels, coarsening, relax, cycle, guess, tol, agglomerate)
    (4, 2, "FCF", "V", "zero", 0.0, 1),
    (4, 2, "F", "F", "nested", 0.0, 4),
    (3, [4, 2], ["F", "FCF"], "V", "zero", 1e-300, 8),
    (5, 2, "FCF", "V", "zero", 0.0, 100),
]


def close(a, b):
    return (a - b).abs().max() <= 1e-12 * max(b.abs().max(), 1e-300)


failures, cases, gathered = [], 0, 0
for name, (prop, u0), t1 in PROBLEMS:
    for n in (64, 61):
        for levels, m, relax, cycle, guess, tol, agg in SETTINGS:
            kw = dict(levels=levels, coarsening=m, relax=relax, cycle=cycle, initial_guess=guess,
                      tol=tol, max_iter=4, min_coarse=1)
            plain = mgrit.solve(prop, u0, n, 0.0, t1, mgrit.Config(**kw), comm=comm)
            solver = mgrit.Solver(prop, u0, n, 0.0, t1, mgrit.Config(agglomerate=agg, **kw),
                                  comm=comm)
            gathered += solver._gathered is not None
            mine = solver.solve(u0)
            serial = mgrit.solve(prop, u0, n, 0.0, t1, mgrit.Config(**kw))
            cases += 1
            label = f"{name} N={n} levels={levels} m={m} {relax} {cycle} {guess} agg={agg}"
            for k, (a, b) in enumerate(zip(mine.residuals, plain.residuals)):
                if abs(a - b) > 1e-12 * abs(b):
                    failures.append(f"{label}: residual {k} {a!r} vs {b!r}")
            if len(mine.residuals) != len(plain.residuals) or not close(mine.states,
                                                                        plain.states):
                failures.append(f"{label}: states differ from the plain solve's")
            own = serial.states[mine.first_index: mine.first_index + len(mine.states)]
            if not close(mine.states, own) or not close(mine.final, serial.final):
                failures.append(f"{label}: states differ from the serial solve's")

report({"size": comm.size, "cases": cases, "gathered": gathered, "failures": failures[:20]})
