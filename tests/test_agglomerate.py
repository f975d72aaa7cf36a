"""Coarse levels solved on every rank after one reduction (`Config.agglomerate`): the same
residual histories and states as the solve that passes them from rank to rank and as the
reference implementation, fewer hops on the critical path, and clear refusals."""

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

import mgrit
from mgrit.app.replay import Interconnect, replay
from mgrit.comm.tracing import Tracer, TracingComm
from mgrit.comm.virtual import run_ranks
from mgrit.core.agglomerate import first_gathered
from mgrit.core.grid import build_hierarchy, split_steps
from mgrit.problems import Dahlquist

from cases import dahlquist_problem, resnet_problem
from reference_mgrit import reference_mgrit


def _run(prop, u0, n, t1, cfg, ranks, blocks=None):
    """Every rank's (residuals, first index, states, final, first gathered level)."""
    def program(comm):
        solver = mgrit.Solver(prop, u0, n, 0.0, t1, cfg, comm, blocks=blocks)
        result = solver.solve(u0)
        gathered = solver._gathered
        return (result.residuals, result.first_index, result.states.clone(), result.final,
                None if gathered is None else gathered.first)
    return [program(None)] if ranks == 1 else run_ranks(ranks, program)


def _assert_close(a, b):
    assert a.shape == b.shape
    scale = max(float(b.abs().max()), 1e-300)
    assert float((a - b).abs().max()) <= 1e-12 * scale


def _uneven(n, ranks):
    """Blocks far from an even split: rank r's share grows with r."""
    weights = [r + 1 for r in range(ranks)]
    cuts = [0] + [round((n + 1) * sum(weights[:r + 1]) / sum(weights)) for r in range(ranks)]
    return [(cuts[r], cuts[r + 1] - 1) for r in range(ranks)]


SETTINGS = [  # levels, coarsening, relax, cycle, guess, tol, agglomerate
    (4, 2, "FCF", "V", "zero", 0.0, 4),
    (4, 2, "F", "F", "nested", 0.0, 8),
    (3, [4, 2], ["F", "FCF"], "V", "zero", 1e-300, 8),
    (5, 2, "FCF", "F", "zero", 0.0, 100),
]


@pytest.mark.parametrize("ranks,uneven,problem", [
    *[(r, False, p) for r in (1, 2, 3, 4) for p in ("dahlquist", "complex", "resnet",
                                                    "resnet32")],
    *[(r, True, p) for r in (2, 3, 4) for p in ("dahlquist", "resnet32")]])
def test_gathered_solve_equals_the_solve_passed_from_rank_to_rank(ranks, uneven, problem):
    """Residual histories and every rank's states to 1e-12 relative, on even and uneven
    splits, and the levels gathered are those with at most `agglomerate` steps per rank."""
    prop, u0 = {"dahlquist": dahlquist_problem(-1.0),
                "complex": dahlquist_problem(-0.2 + 1.5j, torch.complex128),
                "resnet": resnet_problem(num_steps=64),
                "resnet32": resnet_problem(num_steps=64, dtype=torch.float32)}[problem]
    n = 61
    blocks = _uneven(n, ranks) if uneven else None
    for levels, m, relax, cycle, guess, tol, agg in SETTINGS:
        kw = dict(levels=levels, coarsening=m, relax=relax, cycle=cycle, initial_guess=guess,
                  tol=tol, max_iter=4, min_coarse=1)
        plain = _run(prop, u0, n, 2.0, mgrit.Config(**kw), ranks, blocks)
        mine = _run(prop, u0, n, 2.0, mgrit.Config(agglomerate=agg, **kw), ranks, blocks)
        sizes = [n]
        for f in (m if isinstance(m, list) else [m] * (levels - 1)):
            sizes.append(sizes[-1] // f)
        expect = [lvl for lvl in range(1, levels) if sizes[lvl] <= agg * ranks]
        for (res_a, first_a, states_a, final_a, gathered), (res_b, first_b, states_b, final_b,
                                                           none) in zip(mine, plain):
            assert none is None
            assert gathered == (expect[0] if expect and ranks > 1 else None)
            assert len(res_a) == len(res_b)
            np.testing.assert_allclose(res_a, res_b, rtol=1e-12, atol=0)
            assert first_a == first_b
            _assert_close(states_a, states_b)
            _assert_close(final_a, final_b)


def _numpy_step(prop, strides):
    def step(u, level, index, t, dt):
        s = mgrit.Step(level, index, index * strides[level], t, dt)
        return prop.step(torch.from_numpy(np.array(u)), s).numpy()
    return step


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("cycle", ["V", "F"])
def test_gathered_solve_equals_the_reference(ranks, cycle):
    """Every gathered level (agglomerate large): histories and the states of all ranks
    together against the list-based reference implementation."""
    prop, u0 = resnet_problem(num_steps=64)
    n, levels, m = 64, 4, 2
    cfg = mgrit.Config(levels=levels, coarsening=m, relax="FCF", cycle=cycle, tol=0.0,
                       max_iter=4, min_coarse=1, agglomerate=1000)
    out = _run(prop, u0, n, 1.0, cfg, ranks)
    assert all(o[4] == 1 for o in out)
    ref_res, ref_states = reference_mgrit(
        _numpy_step(prop, [1, 2, 4, 8]), u0.numpy(), n, 0.0, 1.0, levels=levels,
        coarsening=[m] * 3, cf_sweeps=[1, 1, 1, 0], cycle=cycle, max_iter=4, tol=0.0)
    for residuals, first, states, final, _ in out:
        np.testing.assert_allclose(residuals, ref_res, rtol=1e-10, atol=0)
        _assert_close(states, torch.from_numpy(ref_states[first: first + len(states)]))


def _hop_depth(ranks, n, agg):
    """Traces of one V-cycle (4 levels, m = 4, F/FCF/FCF) on `ranks` virtual ranks, every
    compute span cut to zero and replayed with hops of 1 s: the most message hops any
    chain of the solve passes through. Also each rank's sends by tag and collectives."""
    prop, u0 = Dahlquist(-1.0), torch.tensor([1.0], dtype=torch.float64)
    cfg = mgrit.Config(levels=4, coarsening=4, relax=("F", "FCF", "FCF"), max_iter=1, tol=0.0,
                       min_coarse=1, agglomerate=agg)

    def program(comm):
        tracer = Tracer(time.thread_time)
        solver = mgrit.Solver(prop, u0, n, 0.0, 1.0, cfg, TracingComm(comm, tracer))
        tracer.start()
        solver.solve(u0)
        return [["compute", 0.0] if e[0] == "compute" else e for e in tracer.stop()]
    traces = run_ranks(ranks, program)
    depth = replay(traces, Interconnect(1.0, 1e30, 0.0)).total
    tags = {int(e[3].split(":")[1]) for t in traces for e in t if e[0] == "send"}
    collectives = [sum(e[0] == "collective" for e in t) for t in traces]
    sizes = {e[4] for e in traces[0] if e[0] == "collective"}
    return depth, tags, collectives, sizes


@pytest.mark.parametrize("ranks,agg,first", [(16, 1, 3), (64, 1, 2), (64, 4, 1)])
def test_gathering_takes_hops_off_the_path(ranks, agg, first):
    """N = 1024: the gathered levels send no message but the injected value's ghost of the
    first gathered level (tag 2 a + 1), each rank makes one reduction more, of the size
    the first gathered level's cycle reads, and the longest
    chain of hops is shorter by at least the coarsest level's march (one hop per rank that
    owns coarsest points, 16 of them) less the reduction's ceil(log2 P) hops and the
    first gathered level's relaxation hops the march overlapped."""
    grids = build_hierarchy(1024, [4, 4, 4], 4, 1)
    assert first_gathered(grids, ranks, agg) == first
    plain_depth, plain_tags, plain_coll, plain_sizes = _hop_depth(ranks, 1024, 0)
    depth, tags, coll, sizes = _hop_depth(ranks, 1024, agg)
    # the reduction carries g at points 1..N_a, v_0 and v at the C-points after 0 (float64
    # scalars): N_a + 1 + N_a / m states, the coarsest level N_a + 1
    n_a = grids[first].num_steps
    assert sizes - plain_sizes == {8 * (n_a + 1 + (n_a // 4 if first < 3 else 0))}
    assert {2 * 3} <= plain_tags                    # the coarsest level's march is messages
    assert not any(t // 2 > first for t in tags)
    assert not any(t // 2 == first and t % 2 == 0 for t in tags)
    assert coll == [c + 1 for c in plain_coll]
    log_p = int(np.ceil(np.log2(ranks)))
    assert depth < plain_depth
    assert depth >= log_p
    # the plain path holds the coarsest level's march: 15 hops at least
    assert plain_depth >= 15


def test_one_rank_and_zero_gather_nothing():
    grids = build_hierarchy(1024, [4, 4, 4], 4, 1)
    assert first_gathered(grids, 1, 100) is None
    assert first_gathered(grids, 64, 0) is None
    assert split_steps(10, 2)   # the partition the solver uses is untouched


@pytest.mark.parametrize("value,error", [(-1, ValueError), (True, TypeError), (1.5, TypeError),
                                         ("2", TypeError)])
def test_bad_agglomerate_is_refused(value, error):
    with pytest.raises(error, match="agglomerate"):
        mgrit.Config(agglomerate=value)


def test_agglomerate_with_cuda_graphs_is_refused():
    with pytest.raises(ValueError, match="agglomerate"):
        mgrit.Config(agglomerate=2, cuda_graphs=True)


def test_propagator_with_local_steps_refuses_before_any_message():
    """A propagator whose steps read rank-local data (`local_steps`) cannot be gathered:
    refused at construction, before the settings are agreed between ranks."""
    class Local(Dahlquist):
        local_steps = True

    class Comm:
        rank, size = 0, 2

        def __getattr__(self, name):
            raise AssertionError(f"communicated: {name}")

        def allreduce_sum(self, value):
            raise AssertionError("communicated")

        def irecv(self, *args):
            raise AssertionError("communicated")

    u0 = torch.tensor([1.0])
    with pytest.raises(ValueError, match="local_steps"):
        mgrit.Solver(Local(-1.0), u0, 16, 0.0, 1.0, mgrit.Config(agglomerate=1), Comm())
    mgrit.Solver(Local(-1.0), u0, 16, 0.0, 1.0, mgrit.Config())    # no gathering: accepted


def _network_on_ranks(kind, num_steps, forward, backward, x, y, ranks, steps=2,
                      kernels=None):
    """A layer-parallel network's output, loss and parameter gradients on `ranks` virtual
    ranks, every rank's, after `steps` SGD steps (each rank builds the whole network with
    the same seed and keeps its own layers), computing with `kernels`."""
    from nets import PARTS

    def program(comm):
        torch.manual_seed(1)
        opening, closing, step = PARTS[kind]()
        model = mgrit.LayerParallel(step, num_steps, 1.0, forward=forward, backward=backward,
                                    comm=comm, opening=opening, closing=closing,
                                    kernels=kernels).double()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(steps):
            optimizer.zero_grad()
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            loss.backward()
            optimizer.step()
        return (out.detach(), loss.detach(), [p.grad.clone() for p in model.parameters()],
                model.stats)
    return run_ranks(ranks, program)


# (levels, coarsening, relax, initial guess, forward cycles, backward cycles)
NETWORK_SETTINGS = [(2, 4, "F", "nested", 0, 0), (3, 2, ("F", "FCF"), "zero", 2, 1),
                    (3, 2, "F", "nested", 1, 0)]


@pytest.mark.parametrize("ranks", [2, 3])
def test_gathered_training_on_torchs_dense_kernels_equals_the_plain_one(ranks):
    """The dense network on torch's kernels (`kernels="torch"`, as where no C compiler
    runs): the adjoint of gathered levels takes a batch's values from torch's batched
    steps, and trains as the plain network does, to round-off."""
    from nets import data

    x, y = data("dense", 4)
    config = mgrit.Config(levels=3, coarsening=2, max_iter=2, tol=0.0, min_coarse=1)
    plain = _network_on_ranks("dense", 8, config, config, x, y, ranks, kernels="torch")
    gathered = replace(config, agglomerate=1)
    mine = _network_on_ranks("dense", 8, gathered, gathered, x, y, ranks, kernels="torch")
    for (out_a, loss_a, grads_a, _), (out_b, loss_b, grads_b, _) in zip(mine, plain):
        for a, b in [(out_a, out_b), (loss_a, loss_b), *zip(grads_a, grads_b)]:
            _assert_close(a, b)


@pytest.mark.parametrize("kind,num_steps", [("dense", 32), ("dense", 30), ("conv", 16),
                                           ("gelu", 16)])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_gathered_layer_parallel_training_equals_the_plain_one(kind, num_steps, ranks):
    """A layer-parallel network whose forward and adjoint solves gather their coarse levels
    (the layers, and the adjoint's forward states, fetched to every rank before each solve)
    trains as one whose coarse levels pass from rank to rank: outputs, losses, residual
    histories and every parameter gradient after two SGD steps, on every rank, to the bit
    with the dense network's native kernels and to round-off with torch's convolutions and
    a module the kernels do not cover (GELU, through torch.func)."""
    from nets import data

    x, y = data(kind, 4)
    for levels, m, relax, guess, up, down in NETWORK_SETTINGS:
        def config(cycles, agglomerate):
            return mgrit.Config(levels=levels, coarsening=m, relax=relax, initial_guess=guess,
                                max_iter=cycles, tol=0.0, min_coarse=1, agglomerate=agglomerate)
        plain = _network_on_ranks(kind, num_steps, config(up, 0), config(down, 0), x, y, ranks)
        mine = _network_on_ranks(kind, num_steps, config(up, 1000), config(down, 1000), x, y,
                                 ranks)
        for (out_a, loss_a, grads_a, stats_a), (out_b, loss_b, grads_b, stats_b) in zip(
                mine, plain):
            pairs = [(out_a, out_b), (loss_a, loss_b), *zip(grads_a, grads_b)]
            pairs += [(torch.tensor(stats_a[k]["residuals"]), torch.tensor(stats_b[k]["residuals"]))
                      for k in ("forward", "backward")]
            for a, b in pairs:
                if kind == "dense":
                    assert torch.equal(a, b), (levels, guess)
                else:
                    _assert_close(a, b)


def test_gathered_layer_parallel_steps_fetch_before_each_solve():
    """On 4 virtual ranks a 2-level network whose coarse level is gathered fetches what its
    coarse steps read in one reduction a kind: the forward the layers, the adjoint the
    forward states; and every rank holds every coarse layer."""
    from nets import data

    x, y = data("dense", 4)
    cfg = mgrit.Config(levels=2, coarsening=4, initial_guess="nested", max_iter=0, tol=0.0,
                       min_coarse=1, agglomerate=1000)

    def program(comm):
        tracer = Tracer()
        torch.manual_seed(1)
        from nets import PARTS

        opening, closing, step = PARTS["dense"]()
        model = mgrit.LayerParallel(step, 32, 1.0, forward=cfg, backward=cfg,
                                    comm=TracingComm(comm, tracer), opening=opening,
                                    closing=closing).double()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        tracer.start()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        events = tracer.stop()
        lo, hi = model.layer_range
        return ([e[1] for e in events if e[0] == "collective"],
                set(model.layers.ghosts), set(range(lo, hi + 1)))
    for collectives, ghosts, owned in run_ranks(4, program):
        # the forward's layers (the adjoint's too: the parameters do not change between
        # the passes) and its final reduction; the adjoint's states and its final
        # reduction (the input check is an allgather)
        assert collectives.count("allreduce") == 4, collectives
        # every layer a coarse step starts from: owned or a ghost, and the rank holds most
        # of them as ghosts
        assert set(range(0, 32, 4)) <= ghosts | owned
        assert len(set(range(0, 32, 4)) & ghosts) >= 6


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_gathered_solve_over_mpi(mpi, nprocs):
    """Dahlquist (real, complex), heat, dense ResNet; N = 61, 64; V/F, F/FCF, zero/nested:
    with agglomerate equal to the plain MPI solve and to the serial one to 1e-12."""
    run = mpi("agglomerate.py", nprocs, timeout=240)
    assert run.returncode == 0, run.stderr
    for rank, report in run.by_rank().items():
        assert report["cases"] == 32
        assert report["gathered"] > 0
        assert report["failures"] == [], f"rank {rank}: {report['failures']}"


def test_gathered_tool_floor_falls_and_bad_arguments_are_refused():
    """`benchmarks.studies.gathered`: on 16 virtual ranks (N = 1024, the coarsest level
    gathered with agglomerate 1) the communication floor on the cluster network (compute
    cut to zero) falls, and lies below the predicted solve; bad --ranks and --agglomerate
    stop with a message. (Counted in hops alone, with no per-message overhead, the same
    two cycles lengthen, 19 to 28: the reduction waits for every rank, where the
    rank-to-rank solve starts the second cycle on the first ranks while the last finish
    the first.)"""
    from benchmarks.studies import gathered
    from benchmarks.studies.hops import OVERHEAD
    from benchmarks.scaling.study import CLUSTER_BANDWIDTH, CLUSTER_LATENCY

    cluster = Interconnect(CLUSTER_LATENCY, CLUSTER_BANDWIDTH, OVERHEAD)
    plain = gathered.point(16, 0, cluster)
    mine = gathered.point(16, 1, cluster)
    assert mine["floor"] < plain["floor"]
    assert mine["floor"] <= mine["predicted"] and plain["floor"] <= plain["predicted"]
    for argv in (["--ranks", "a"], ["--agglomerate", "-1"], ["--ranks", "0"]):
        with pytest.raises(SystemExit, match="ranks|agglomerate"):
            gathered.main(argv)


def test_gathered_training_takes_the_coarse_sweeps_off_the_path():
    """`benchmarks.studies.gathered --training`'s points: W2's training step with its
    coarse level gathered has fewer hops on the predicted path than with the coarse level
    passed from rank to rank (16 virtual ranks, the coarse level's 4 points a rank
    gathered: the two sweeps' 2 x 15 hops become two reductions of 4 hops)."""
    from benchmarks.scaling.study import CLUSTER_BANDWIDTH, CLUSTER_LATENCY
    from benchmarks.studies import gathered
    from benchmarks.studies.hops import OVERHEAD
    from benchmarks.studies.nested import virtual

    cluster = Interconnect(CLUSTER_LATENCY, CLUSTER_BANDWIDTH, OVERHEAD)
    hops = {agg: virtual("w2", gathered.training_options(agg), 16, cluster,
                         False)["critical"]["hops"] for agg in (0, 4)}
    assert hops[4] < hops[0] - 16, hops


class _CompiledLinear:
    """u' = lam u by forward Euler with every phase one compiled call (a loop over its steps
    written as `g + Phi(u)` rounds), batched where it is not: the solver (its batched
    executor) records a cycle and replays it."""

    def __init__(self, lam: float) -> None:
        self.lam = lam

    def step(self, u, s):
        return u * (1.0 + s.dt * self.lam)

    def step_batch(self, states, steps):
        return states * (1.0 + steps.dt * self.lam)

    def program_key(self, level, parallel):
        return "linear"

    def step_program(self, steps, rows, parallel):
        def run():
            for s, (u, out, g) in zip(steps, rows):
                phi = self.step(u, s)
                if g is None:
                    out.copy_(phi)
                else:
                    torch.add(g, phi, out=out)
        return run


@pytest.mark.parametrize("ranks", [2, 3])
def test_gathered_levels_in_a_replayed_cycle(ranks, monkeypatch):
    """With a propagator that compiles every phase the solver records its first cycle and
    replays it (the gathered solve is one call of the record): the same histories and
    states as without records, and as the solve passed from rank to rank."""
    prop, u0 = _CompiledLinear(-1.0), torch.tensor([1.0, -0.5], dtype=torch.float64)
    kw = dict(levels=4, coarsening=2, relax="FCF", tol=0.0, max_iter=4, min_coarse=1)

    def run(agg, replays):
        monkeypatch.setattr(mgrit.Solver, "replays", replays)

        def program(comm):
            solver = mgrit.Solver(prop, u0, 48, 0.0, 3.0, mgrit.Config(agglomerate=agg, **kw),
                                  comm)
            result = solver.solve(u0)
            return (result.residuals, result.states.clone(), solver._schedule is not None,
                    solver._gathered is not None)
        return run_ranks(ranks, program)

    replayed, direct, plain = run(8, True), run(8, False), run(0, True)
    for (res_a, states_a, rec, gath), (res_b, states_b, _, _), (res_c, states_c, _, _) in zip(
            replayed, direct, plain):
        assert rec and gath
        assert res_a == res_b
        assert torch.equal(states_a, states_b)
        np.testing.assert_allclose(res_a, res_c, rtol=1e-12, atol=0)
        _assert_close(states_a, states_c)


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_gathered_layer_parallel_training_over_mpi(mpi, nprocs):
    """Over MPI, the gathered network's outputs, losses, residual histories and parameter
    gradients equal the plain one's: to the bit with the dense network's native kernels,
    to round-off with torch's convolutions (whose rounding may follow where a layer's
    tensors lie: a gathered layer is a copy). Dense N = 30, conv N = 16; three settings."""
    run = mpi("agglomerate_network.py", nprocs, timeout=300)
    assert run.returncode == 0, run.stderr
    for rank, rep in run.by_rank().items():
        assert len(rep["results"]) == 6
        for case, difference in rep["results"].items():
            assert difference <= (0.0 if case.startswith("dense") else 1e-12), (rank, case)
