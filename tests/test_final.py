"""The state at t1 on every rank: sent from the rank that holds it, with the residual norms
in one reduction where a solve runs a fixed number of cycles, every value's bits kept
(signed zeros, float32, complex), on 1-4 virtual ranks."""

import pytest
import torch

import mgrit
from mgrit.comm.tracing import Tracer, TracingComm
from mgrit.comm.virtual import run_ranks
from mgrit.problems import Dahlquist


def _initial(dtype):
    values = [-0.0, 1.0, -2.5, 0.0, 3.0e-30]
    u0 = torch.tensor(values, dtype=torch.float64)
    if dtype.is_complex:
        u0 = torch.complex(u0, torch.tensor(values[::-1], dtype=torch.float64))
    return u0.to(dtype)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.complex128])
@pytest.mark.parametrize("tol", [0.0, 1e-9])
def test_every_rank_gets_the_final_state_of_the_rank_that_holds_it(ranks, dtype, tol):
    """Every rank's `final` has the bits of the last rank's last state (signed zeros too),
    and the residual norms are the same on every rank; a fixed-cycle solve (tol = 0) ends
    with one reduction and no broadcast, a tolerance-driven one broadcasts the state."""
    u0 = _initial(dtype)
    config = mgrit.Config(levels=3, coarsening=2, tol=tol, max_iter=3, min_coarse=1)

    def program(comm):
        tracer = Tracer()
        solver = mgrit.Solver(Dahlquist(-0.5), u0, 24, 0.0, 2.0, config,
                              TracingComm(comm, tracer))
        tracer.start()
        res = solver.solve(u0)
        events = tracer.stop()
        ops = [e[1] for e in events if e[0] == "collective"]
        return res.final, res.states[-1].clone(), res.residuals, ops

    out = run_ranks(ranks, program)
    owner_state = out[-1][1]
    owner = torch.view_as_real(owner_state) if dtype.is_complex else owner_state
    for final, _, residuals, ops in out:
        assert torch.equal(final, owner_state) and final.dtype == dtype
        real = torch.view_as_real(final) if dtype.is_complex else final
        assert torch.equal(torch.signbit(real), torch.signbit(owner))
        assert residuals == out[0][2]
        if ranks > 1:
            assert ops.count("bcast") == (0 if tol == 0.0 else 1), ops
            if tol == 0.0:
                assert ops[-1] == "allreduce" and ops.count("allreduce") == 1, ops


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16,
                                   torch.complex64])
def test_the_reduction_keeps_every_bit_of_the_final_state(dtype):
    """Whatever the last rank's state holds (negative zeros, infinities, NaN, subnormal
    numbers, the largest values of its dtype), every rank of 3 gets its bits, and the sums
    of the residual parts."""
    info = torch.finfo(dtype)
    values = torch.tensor([-0.0, 0.0, float("inf"), -float("inf"), float("nan"),
                           info.tiny / 4, -info.max, info.eps], dtype=torch.float64)
    special = values.to(dtype if not dtype.is_complex else torch.float32)
    if dtype.is_complex:
        special = torch.complex(special, special.flip(0))
    u0 = torch.zeros_like(special)
    config = mgrit.Config(levels=2, coarsening=2, tol=0.0, max_iter=1, min_coarse=1)

    def program(comm):
        solver = mgrit.Solver(Dahlquist(-0.5), u0, 12, 0.0, 1.0, config, comm)
        if comm.rank == solver._final_owner:
            fine = solver.levels[0]
            fine.u[fine.row(solver.num_steps)] = special
        parts = [float(comm.rank + 1), 0.25 * comm.rank]
        return solver._residuals_and_final(parts, u0)

    for residuals, final in run_ranks(3, program):
        assert residuals == [6.0 ** 0.5, 0.75 ** 0.5]
        assert final.dtype == dtype
        got = torch.view_as_real(final) if dtype.is_complex else final
        want = torch.view_as_real(special) if dtype.is_complex else special
        bits = {torch.float64: torch.int64, torch.float32: torch.int32,
                torch.float16: torch.int16}[got.dtype]
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(bits), want[~nan].view(bits))


def test_the_reduced_final_state_equals_the_broadcast_one():
    """The same fixed-cycle solve on 3 ranks with the state at t1 reduced with the residual
    norms and broadcast on its own: the same bits, the same residual norms."""
    u0 = _initial(torch.float64)
    config = mgrit.Config(levels=3, coarsening=2, tol=0.0, max_iter=2, min_coarse=1)

    def program(comm, merged):
        solver = mgrit.Solver(Dahlquist(-0.5), u0, 24, 0.0, 2.0, config, comm)
        res = solver.solve(u0) if merged else _separately(solver, u0)
        return res.final, res.residuals

    for a, b in zip(run_ranks(3, lambda c: program(c, True)),
                    run_ranks(3, lambda c: program(c, False))):
        assert torch.equal(a[0], b[0]) and a[1] == b[1]


def _separately(solver, u0):
    """A solve whose state at t1 is broadcast after its residual norms are reduced."""
    res = solver.solve(u0, final=False)
    final = torch.zeros_like(u0)
    if solver.comm.rank == solver._final_owner:
        final.copy_(solver._final_row())
    solver.comm.bcast_(final, solver._final_owner)
    res.final = final
    return res
