"""Warm virtual ranks (benchmarks.studies.warm): a rank run alone with what it received in a
virtual run repeats that run exactly, and so do its traces."""

import torch

import mgrit
from mgrit.comm.virtual import run_ranks

from benchmarks.studies import warm
from cases import resnet_problem


def test_a_rank_alone_on_what_it_received_computes_what_it_computed_among_all():
    prop, u0 = resnet_problem(num_steps=48)
    config = mgrit.Config(levels=3, coarsening=4, tol=1e-9, max_iter=10)
    received = [warm.Received() for _ in range(3)]

    def program(comm):
        res = mgrit.solve(prop, u0, 48, 0.0, 1.0, config, comm=comm)
        return res.residuals, res.states.clone(), res.final.clone()

    together = run_ranks(3, lambda comm: program(warm.RecordingComm(comm, received[comm.rank])))
    assert all(r.messages and r.collectives for r in received[1:])
    for rank in range(3):
        alone = program(warm.ReplayComm(received[rank], rank, 3))
        assert alone[0] == together[rank][0]
        assert torch.equal(alone[1], together[rank][1])
        assert torch.equal(alone[2], together[rank][2])


def test_warm_traces_hold_the_virtual_runs_events_with_their_own_compute():
    cold, hot = warm.traces("w2", ranks=2, repeats=1, warmup=1)
    for c, h in zip(cold[0], hot[0]):
        assert warm._same_events(c, h)
        assert [e for e in h if e[0] == "send"]     # both ranks send in W2's step
        assert all(e[1] > 0 for e in h if e[0] == "compute")
        assert h is not c


def test_a_point_predicts_both_kinds_on_every_network():
    from mgrit.app.replay import Interconnect

    networks = {"a": Interconnect(5e-6, 1e10, 5e-7), "b": Interconnect(1e-6, 2e9, 5e-7)}
    res = warm.point(2, networks, repeats=1, warmup=1)
    for kind in ("cold", "warm"):
        assert set(res[kind]) == {"a", "b"}
        for pred in res[kind].values():
            assert 0 < pred["busy_mean"] <= pred["seconds"]
            assert pred["critical"]["hops"] > 0
