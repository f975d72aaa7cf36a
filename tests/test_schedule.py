"""Recorded and replayed cycles (`mgrit.core.schedule`): a solver whose phases are all
compiled records its first cycle and replays it after; the replayed cycles give the bits of
cycles run phase by phase, on 1-4 virtual ranks, for V- and F-cycles, F and FCF relaxation,
fixed and tolerance-driven iteration counts, and through layer-parallel training; a change
of program keys makes a new record; a phase run step by step leaves nothing to replay."""

import pytest
import torch

import mgrit
from mgrit.comm.virtual import run_ranks
from mgrit.core import cycle, schedule

from test_compiled import _random_case, _train
from test_native import native_kernels, needs_native  # noqa: F401 (the fixture)


class CompiledScalar:
    """u' = lam u by forward Euler, with compiled phases made of its own steps in Python:
    `key` is what `program_key` returns (None: no compiled phases); `hooked` adds
    `hook_shift` to the key while the final-sweep hook is on."""

    def __init__(self, lam: float = -0.7) -> None:
        self.lam = lam
        self.key: object = ("k", 1)
        self.hooked = False
        self.hook_shift = 0
        self.built = 0
        self.runs = 0

    def step(self, u, s):
        return u * (1.0 + self.lam * s.dt)

    def step_batch(self, states, steps):
        return states * (1.0 + self.lam * steps.dt)

    def program_key(self, level, parallel):
        if self.key is None:
            return None
        return (*self.key, self.hook_shift) if self.hooked else self.key

    def step_program(self, steps, rows, parallel):
        self.built += 1

        def run():
            self.runs += 1
            for s, (u, out, g) in zip(steps, rows):
                torch.mul(u, 1.0 + self.lam * s.dt, out=out)
                if g is not None:
                    out.add_(g)
        return run

    def final_sweep(self, active):
        self.hooked = active


def _solve_ranks(ranks, config, replays, monkeypatch, change=None, solves=3):
    """Every rank's level-0 states and residuals after `solves` solves of one Solver
    (`change(prop, k)` before solve k), and each rank's count of replayed cycles."""
    monkeypatch.setattr(cycle.Solver, "replays", replays)
    replayed = []
    monkeypatch.setattr(schedule.Schedule, "replay",
                        lambda self, _f=schedule.Schedule.replay: replayed.append(1) or _f(self))
    u0 = torch.linspace(0.5, 1.5, 6, dtype=torch.float64)

    def program(comm):
        prop = CompiledScalar()
        solver = cycle.Solver(prop, u0, 37, 0.0, 2.0, config, comm,
                              final_sweep=prop.final_sweep)
        out = []
        for k in range(solves):
            if change is not None:
                change(prop, k)
            res = solver.solve(u0)
            out += [res.states.clone(), torch.tensor(res.residuals), res.final.clone()]
        return out, solver

    results = run_ranks(ranks, program)
    return [t for states, _ in results for t in states], [s for _, s in results], replayed


CONFIGS = {
    "V, FCF, fixed cycles": mgrit.Config(levels=3, coarsening=3, max_iter=4, tol=0.0),
    "F-cycle, F then FCF": mgrit.Config(levels=4, coarsening=2, relax=("F", "FCF", "FCF"),
                                        cycle="F", max_iter=3, tol=0.0, min_coarse=1),
    "to a tolerance": mgrit.Config(levels=3, coarsening=4, max_iter=8, tol=1e-9),
    "relative tolerance, two CF sweeps": mgrit.Config(levels=2, coarsening=5, relax_sweeps=2,
                                                      max_iter=6, tol=1e-7,
                                                      tol_kind="relative"),
    "one level": mgrit.Config(levels=1, max_iter=1),
}


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_replayed_cycles_give_the_bits_of_cycles_run_phase_by_phase(ranks, name,
                                                                    monkeypatch):
    config = CONFIGS[name]
    got, solvers, replayed = _solve_ranks(ranks, config, True, monkeypatch)
    expected, plain, none = _solve_ranks(ranks, config, False, monkeypatch)
    assert not none and all(s._schedule is None for s in plain)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b), name
    # every rank records its first cycle and replays every later one, in this solve and
    # the next ones (a rank without points on a level replays its empty share of it)
    cycles = sum(len(got[3 * k + 1]) for k in range(3))
    assert len(replayed) == ranks * (cycles - 1), name
    assert all(s._schedule is not None for s in solvers)


def test_a_new_program_key_makes_a_new_record(monkeypatch):
    """Keys changed between solves (new storage, say): the old record is dropped, the
    cycle is recorded again under the new key and the phases compiled again; no key (the
    propagator declines) leaves nothing to replay; results are those of the phase-by-phase
    solver throughout."""
    config = CONFIGS["V, FCF, fixed cycles"]
    keys = [("k", 1), ("k", 1), ("k", 2), None, ("k", 2)]

    def change(prop, k):
        prop.key = keys[k]

    got, solvers, replayed = _solve_ranks(2, config, True, monkeypatch, change, len(keys))
    expected, _, _ = _solve_ranks(2, config, False, monkeypatch, change, len(keys))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    # solves 0, 1: one record, then replays; 2: a new record; 3: none; 4: the program of
    # key 2 is kept by the levels, so its phases are not compiled again
    per_rank = config.max_iter - 1 + config.max_iter + config.max_iter - 1 + config.max_iter - 1
    assert len(replayed) == 2 * per_rank
    for solver in solvers:
        assert solver._schedule is not None


def test_a_key_that_changes_at_the_hook_unlike_its_record_is_an_error(monkeypatch):
    """Keys after the final-sweep hook must follow from those before it: a propagator
    whose keys before the hook are as recorded but after it are not is refused, not
    replayed with stale programs."""
    config = CONFIGS["V, FCF, fixed cycles"]

    def change(prop, k):
        prop.hook_shift = k

    with pytest.raises(RuntimeError, match="final-sweep hook"):
        _solve_ranks(1, config, True, monkeypatch, change, 2)


def test_a_phase_run_step_by_step_leaves_nothing_to_replay(monkeypatch):
    """C-relaxation with a weight other than 1 runs step by step: no cycle is replayed, and
    the cycle is recorded once per rank, not again at every cycle, while the keys hold."""
    config = mgrit.Config(levels=3, coarsening=3, max_iter=4, tol=0.0, c_weight=0.7)
    records = []
    original = schedule.Schedule.__init__
    monkeypatch.setattr(schedule.Schedule, "__init__",
                        lambda self, key: records.append(1) or original(self, key))
    got, solvers, replayed = _solve_ranks(2, config, True, monkeypatch)
    assert len(records) == 2
    expected, _, _ = _solve_ranks(2, config, False, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not replayed and all(s._schedule is None for s in solvers)


def test_an_error_while_recording_leaves_no_record_behind(monkeypatch):
    """A phase that raises while its cycle is recorded: the error reaches the caller, the
    levels stop recording, and the next solve records afresh and matches a fresh solver."""
    u0 = torch.ones(3, dtype=torch.float64)
    config = CONFIGS["V, FCF, fixed cycles"]
    prop = CompiledScalar()
    solver = cycle.Solver(prop, u0, 37, 0.0, 2.0, config, final_sweep=prop.final_sweep)
    original = prop.step_program

    def failing(steps, rows, parallel):
        raise ValueError("broken phase")

    prop.step_program = failing
    solver.caps = cycle.Capabilities.of(prop)
    solver.executor.caps = solver.caps
    with pytest.raises(ValueError, match="broken phase"):
        solver.solve(u0)
    assert solver._recording is None and solver._schedule is None
    assert all(level.recorder is None for level in solver.levels)
    prop.step_program = original
    solver.caps = cycle.Capabilities.of(prop)
    solver.executor.caps = solver.caps
    got = solver.solve(u0)
    fresh_prop = CompiledScalar()
    fresh = cycle.Solver(fresh_prop, u0, 37, 0.0, 2.0, config,
                         final_sweep=fresh_prop.final_sweep).solve(u0)
    assert torch.equal(got.states, fresh.states)
    assert solver._schedule is not None


@needs_native
@pytest.mark.parametrize("ranks", [1, 3])
def test_training_replays_its_cycles_and_keeps_its_bits(ranks, monkeypatch):
    """Layer-parallel training with compiled dense tanh phases: forward and adjoint solves
    replay recorded cycles (the second cycle of each, and every cycle of the second step),
    and outputs and gradients equal those of training with every cycle run phase by
    phase."""
    replayed = []
    original = schedule.Schedule.replay
    monkeypatch.setattr(schedule.Schedule, "replay",
                        lambda self: replayed.append(self) or original(self))
    for seed in range(2):
        case = _random_case(300 + 10 * ranks + seed)
        replayed.clear()
        got = _train("auto", ranks, case, torch.float64, monkeypatch)
        assert replayed, case
        monkeypatch.setattr(cycle.Solver, "replays", False)
        expected = _train("auto", ranks, case, torch.float64, monkeypatch)
        monkeypatch.setattr(cycle.Solver, "replays", True)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), case
