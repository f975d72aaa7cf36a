"""CUDA graphs of relaxation sweeps (Config.cuda_graphs): when sweeps are captured, replayed
and dropped, checked here with a stand-in graph on the CPU; the real capture on a GPU."""

import pytest
import torch
from torch import nn

import mgrit
from mgrit.core.propagator import Capabilities
from mgrit.execute import SweepGraphs
from mgrit.execute import graphs as graph_module

from nets import build, data


class _Prop:
    def __init__(self):
        self.key = (1,)

    def step(self, u, s):
        return u

    def graph_key(self):
        return self.key


class _Eager:
    """A propagator without graph_key."""

    def step(self, u, s):
        return u


class _StandIn:
    """A graph on the CPU: replaying runs the captured sweep again."""

    def __init__(self, sweep, log):
        self.sweep = sweep
        log.append("capture")

    def replay(self):
        self.sweep()


class _Capture:
    """Stands in for CudaCapture: warm-up runs the sweep, capture makes a `_StandIn`."""

    def __init__(self, log):
        self.log = log

    def warm_up(self, like, sweep):
        self.log.append("warm-up")
        sweep()

    def capture(self, like, sweep):
        return _StandIn(sweep, self.log)


def test_a_sweep_runs_eagerly_then_is_captured_once_and_replayed(monkeypatch):
    monkeypatch.setattr(SweepGraphs, "device_types", ("cpu",))
    log = []
    prop, like = _Prop(), torch.zeros(1)
    graphs = SweepGraphs(Capabilities.of(prop), _Capture(log))
    calls = []
    sweep = lambda: calls.append(1)  # noqa: E731
    for _ in range(4):
        graphs.run("a", like, sweep)
    assert (len(calls), log, graphs.captured, graphs.replayed) == (
        4, ["warm-up", "capture"], 1, 3)
    prop.key = (2,)                  # the parameters moved: warm up and capture again
    for _ in range(2):
        graphs.run("a", like, sweep)
    assert (len(calls), log, graphs.captured, graphs.replayed) == (
        6, ["warm-up", "capture"] * 2, 2, 4)
    prop.key = None                  # the propagator asks for eager steps
    graphs.run("a", like, sweep)
    assert (len(calls), graphs.captured, graphs.replayed) == (7, 2, 4)
    prop.key = (3,)
    graphs.run("b", like, sweep)     # another sweep has its own count: a warm-up
    assert (len(calls), graphs.captured) == (8, 2)


def test_states_off_cuda_and_propagators_without_a_key_run_eagerly():
    log = []
    calls = []
    for prop in (_Prop(), _Eager()):
        graphs = SweepGraphs(Capabilities.of(prop), _Capture(log))
        for _ in range(3):
            graphs.run("a", torch.zeros(1), lambda: calls.append(1))
        assert (graphs.captured, graphs.replayed) == (0, 0)
    assert (len(calls), log) == (6, [])


def test_config_refuses_retired_streams_and_non_boolean_graphs():
    # the retired executor is refused with the measurement and what to use instead
    for graphs in (False, True):
        with pytest.raises(ValueError, match=r"(?s)'streams'.*retired.*30 to 50 times.*"
                                             r"docs/results.md.*execution='batched'"):
            mgrit.Config(cuda_graphs=graphs, execution="streams")
    with pytest.raises(TypeError, match="cuda_graphs must be True or False, got 1"):
        mgrit.Config(cuda_graphs=1)


def _train(graphs: bool, steps: int = 3):
    cfg = dict(levels=3, coarsening=2, min_coarse=1, relax=("F", "FCF"), tol=0.0)
    fwd = mgrit.Config(max_iter=2, cuda_graphs=graphs, **cfg)
    bwd = mgrit.Config(max_iter=1, cuda_graphs=graphs, **cfg)
    model, _ = build("dense", 16, fwd, bwd)
    x, y = data("dense", 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    model.eval()
    with torch.no_grad():
        losses.append(model(x))
    return model, losses


def test_training_with_graphs_computes_what_it_computes_without(monkeypatch):
    """With the stand-in graph, training and an eval pass take the same numbers as without:
    sweeps are captured once each, replayed after, never while the forward pass keeps its
    outputs for the backward pass, and never for the adjoint (its steps read values)."""
    monkeypatch.setattr(SweepGraphs, "device_types", ("cpu",))
    log = []
    keeping = []
    original = SweepGraphs.run

    def run(self, key, like, sweep):
        prop = self.caps.step.__self__
        keeping.append((type(prop).__name__, getattr(prop, "_keeping", False)))
        if keeping[-1][1]:
            assert prop.graph_key() is None
        return original(self, key, like, sweep)
    monkeypatch.setattr(SweepGraphs, "run", run)
    monkeypatch.setattr(graph_module, "CudaCapture", lambda: _Capture(log))
    model, with_graphs = _train(True)
    _, without = _train(False)
    assert len(with_graphs) == len(without) > 0
    assert all(torch.equal(a, b) for a, b in zip(with_graphs, without))
    passes = model._passes
    solvers = list(passes.forward_solvers.values()) + list(passes.adjoint_solvers.values())
    counts = {}
    for s in solvers:
        c = counts.setdefault(type(s.prop).__name__, [0, 0])
        c[0] += s.executor.graphs.captured
        c[1] += s.executor.graphs.replayed
    assert counts["AdjointPropagator"] == [0, 0]
    captured, replayed = counts["NetworkPropagator"]
    assert captured >= 2 and replayed > captured and log.count("capture") == captured
    assert ("NetworkPropagator", True) in keeping     # asked while keeping: no key
    assert ("AdjointPropagator", False) in keeping


def test_a_conversion_drops_the_captured_sweeps(monkeypatch):
    monkeypatch.setattr(SweepGraphs, "device_types", ("cpu",))
    monkeypatch.setattr(graph_module, "CudaCapture", lambda: _Capture([]))
    model, _ = _train(True, steps=2)
    solver = next(iter(model._passes.forward_solvers.values()))
    before = solver.executor.graphs.captured
    key = solver.prop.graph_key()
    # new storage for every parameter; the old is held, or the allocator could hand the
    # same addresses back (the graphs would then still be right, and kept)
    held = [p.data for p in model.parameters()]
    model.float()
    model.double()
    assert solver.prop.graph_key() != key and held
    x, _ = data("dense", 4)
    model.train()
    for _ in range(2):          # the same solver (shape, dtype, with gradients) as before
        model(x)
    assert next(iter(model._passes.forward_solvers.values())) is solver
    assert solver.executor.graphs.captured > before


# run by `pytest -m gpu` (benchmarks/gpu_check.sh), skipped without a CUDA device
needs_gpu = pytest.mark.gpu


@needs_gpu
def test_cuda_graphs_on_a_gpu_equal_eager_steps():
    """Real capture: a W2-shaped training step and an eval pass, float64, with and without
    graphs on the GPU."""
    results = []
    for graphs in (True, False):
        cfg = dict(levels=4, coarsening=4, min_coarse=1, relax=("F", "FCF", "FCF"), tol=0.0)
        torch.manual_seed(3)
        model = mgrit.LayerParallel(lambda: nn.Sequential(nn.Linear(32, 32), nn.Tanh()), 256,
                                    1.0, mgrit.Config(max_iter=2, cuda_graphs=graphs, **cfg),
                                    mgrit.Config(max_iter=1, cuda_graphs=graphs, **cfg))
        model = model.double().cuda()
        x = torch.randn(8, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        x = x.cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        for _ in range(3):
            opt.zero_grad()
            y = model(x)
            y.square().sum().backward()
            opt.step()
            out.append(y.detach())
        with torch.no_grad():
            model.eval()
            out.append(model(x))
        out += [p.detach().clone() for p in model.parameters()]
        results.append(out)
        if graphs:
            solvers = model._passes.forward_solvers.values()
            assert sum(s.executor.graphs.captured for s in solvers) > 0
    assert len(results) == 2 and len(results[0]) == len(results[1]) > 0
    for a, b in zip(*results):
        assert float((a - b).abs().max()) <= 1e-12 * float(b.abs().max())
