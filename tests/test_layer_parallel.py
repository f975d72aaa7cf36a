"""LayerParallel against serial autograd on the equivalent plain network."""

import pytest
import torch
from torch import nn

import mgrit
from mgrit.comm.virtual import run_ranks
from mgrit.nn.engine import gradients

from nets import INEXACT_CASES, build, data, inexact_training, owned_pairs, relative


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_gradients_and_training_equal_serial_autograd(mpi, nprocs):
    """Dense (N = 13, 16) and conv (N = 7) networks, float64: with levels=1 or converged
    multilevel solves, output, input gradient and every parameter gradient equal serial
    autograd; two SGD-momentum steps reproduce serial training."""
    run = mpi("layer_parallel.py", nprocs, "agreement", timeout=300)
    assert run.returncode == 0, run.stderr
    checked = set()
    for rank, rep in run.by_rank().items():
        for case, values in rep["results"].items():
            checked.add(case)
            if case.endswith("exact"):
                assert values["output"] <= 1e-10 and values["input_grad"] <= 1e-10
                assert values["param_grads"] <= 1e-10, (rank, case, values)
            elif case.endswith("converged"):
                assert max(values["output"], values["input_grad"],
                           values["param_grads"]) <= 1e-8, (rank, case, values)
            else:
                assert case.endswith("train2")
                assert values["params"] <= 1e-10, (rank, case, values)
    assert len(checked) == 8, sorted(checked)


def _rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


def _compare_inexact(got: dict, ref: dict, rows: slice = slice(None), replicas: int = 1) -> set:
    """Every number of a rank's inexact run against the one-process run (1e-12 relative);
    returns the layers compared. With data-parallel `replicas`, a replica's loss is the mean
    over its part of the batch, so its input gradient is `replicas` times the full batch's."""
    ref_out = torch.tensor(ref["output"], dtype=torch.float64)[rows].tolist()
    ref_grad = (torch.tensor(ref["input_grad"], dtype=torch.float64)[rows] * replicas).tolist()
    assert _rel(got["output"], ref_out) <= 1e-12
    assert _rel(got["input_grad"], ref_grad) <= 1e-12
    for layer, tensors in got["layers"].items():
        for name, values in tensors.items():
            expected = ref["layers"][int(layer)][name]
            assert _rel(values["grad"], expected["grad"]) <= 1e-12, (layer, name)
            assert _rel(values["value"], expected["value"]) <= 1e-12, (layer, name)
    return {int(layer) for layer in got["layers"]}


def test_inexact_cases_are_inexact():
    """The rank-count test below compares gradients that are far from exact ones: 2/1
    cycles at 2-4 levels leave an error a broken partition could not hide behind."""
    for kind, n, levels, warm, steps in INEXACT_CASES[:5]:
        inexact = inexact_training(kind, n, levels, warm, steps)
        exact, _ = build(kind, n, mgrit.Config(levels=1), mgrit.Config(levels=1))
        x, y = data(kind, 8)
        xa = x.clone().requires_grad_()
        nn.functional.cross_entropy(exact(xa), y).backward()
        assert _rel(inexact["input_grad"], xa.grad.tolist()) > 1e-4, (kind, n, levels)


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_inexact_training_does_not_depend_on_the_rank_count(mpi, nprocs):
    """MGRIT's arithmetic does not depend on how the layers are split: 2 forward / 1
    backward cycles at 2-4 levels, dense and conv networks with uneven blocks, float64,
    warm starts across three steps: output, input gradient, every layer's parameter
    gradient and the trained parameters on P ranks equal the one-process run."""
    run = mpi("layer_parallel.py", nprocs, "inexact", timeout=300)
    assert run.returncode == 0, run.stderr
    reports = run.by_rank()
    for kind, n, levels, warm, steps in INEXACT_CASES:
        case = f"{kind}-{n}-{levels}-{warm}"
        ref = inexact_training(kind, n, levels, warm, steps)
        covered = set()
        for rep in reports.values():
            covered |= _compare_inexact(rep["results"][case], ref)
        assert covered == set(range(n)), case


@pytest.mark.mpi
def test_inexact_training_with_data_parallelism_equals_one_process(mpi):
    """2 layer ranks x 2 replicas, each replica half the batch, warm starts: the averaged
    inexact gradients and the trained layers equal one process on the full batch."""
    run = mpi("layer_parallel.py", 4, "inexact-data-parallel", timeout=300)
    assert run.returncode == 0, run.stderr
    ref = inexact_training("dense", 13, 3, True, 3)
    covered = set()
    for rep in run.by_rank().values():
        part = rep["results"]["data_rank"]
        covered |= _compare_inexact(rep["results"]["dense"], ref, slice(4 * part, 4 * part + 4),
                                    replicas=2)
    assert covered == set(range(13))


@pytest.mark.mpi
def test_a_model_converted_after_training_sends_its_ghost_layers_in_the_new_dtype(mpi):
    """Coarse steps that start on another rank's layer use its copy, sent before every
    forward pass from buffers made once: converted to float32 after a float64 step, the
    model still agrees with the converted serial network."""
    run = mpi("layer_parallel.py", 3, "converted", timeout=120)
    assert run.returncode == 0, run.stderr
    for rank, rep in run.by_rank().items():
        r = rep["results"]
        assert r["float64"]["params"] < 1e-10, (rank, r)
        assert r["float32"]["output"] < 1e-5 and r["float32"]["param_grads"] < 1e-4, (rank, r)


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2])
def test_float32_gradients_are_as_accurate_as_serial_float32(mpi, nprocs):
    """float32 LayerParallel (exact stepping, and 3-level MGRIT run past convergence) for
    dense, conv and torch.func (GELU) steps, against float64 serial autograd: its errors in
    the output, the input gradient and this rank's parameter gradients are at most twice
    float32 serial autograd's own (the network's float32 round-off, measured on the same
    tensors), and that round-off is float32's (below 1e-5), not float64's."""
    run = mpi("layer_parallel.py", nprocs, "float32", timeout=300)
    assert run.returncode == 0, run.stderr
    reports = run.by_rank()
    assert len(reports) == nprocs
    for rank, rep in reports.items():
        assert len(rep["results"]) == 6
        for case, r in rep["results"].items():
            for lp, serial in (("lp", "serial"), ("output_lp", "output_serial"),
                               ("input_grad_lp", "input_grad_serial")):
                assert 1e-9 < r[serial] < 1e-5, (rank, case, serial, r)
                assert r[lp] <= 2 * r[serial], (rank, case, lp, r)


@pytest.mark.mpi
def test_two_by_two_data_parallel_equals_serial_full_batch(mpi):
    run = mpi("layer_parallel.py", 4, "data-parallel", timeout=120)
    assert run.returncode == 0, run.stderr
    reports = run.by_rank()
    assert {(r["results"]["2x2"]["layer_rank"], r["results"]["2x2"]["data_rank"])
            for r in reports.values()} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    for rep in reports.values():
        assert rep["results"]["2x2"]["params"] <= 1e-10


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_exported_serial_network_gives_the_same_outputs(mpi, nprocs):
    """After inexact training, the exported serial network and the model in eval mode (one
    exact sequential sweep over the ranks) give the exactly solved output."""
    run = mpi("layer_parallel.py", nprocs, "export", timeout=120)
    assert run.returncode == 0, run.stderr
    reports = run.by_rank()
    evaluation = {"eval_difference": pytest.approx(0.0, abs=1e-12), "eval_cycles": 1}
    assert reports[0]["results"]["export"] == {"difference": pytest.approx(0.0, abs=1e-12),
                                              "layers": 9, **evaluation}
    for r in range(1, nprocs):
        assert reports[r]["results"]["export"] == {"is_none": True, **evaluation}


def test_evaluation_is_one_exact_sweep_in_float32_too():
    """Eval mode without gradients steps through the layers once (float32's round-off is far
    above any tolerance a converged MGRIT solve would need) and gives the serial network's
    output; an `inference` config is taken as given."""
    inexact = dict(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, min_coarse=1)
    model, serial = build("dense", 24, mgrit.Config(max_iter=2, **inexact),
                          mgrit.Config(max_iter=1, **inexact))
    model, serial = model.float(), serial.float()
    x, _ = data("dense", 4)
    model.eval()
    with torch.no_grad():
        out, ref = model(x.float()), serial(x.float())
    assert model.stats["forward"]["iterations"] == 1
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-6
    given = mgrit.Config(levels=2, coarsening=2, tol=0.0, max_iter=3)
    model = mgrit.LayerParallel(lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh()), 24,
                                inference=given).eval()
    with torch.no_grad():
        model(torch.randn(4, 8))
    assert model.stats["forward"]["iterations"] == 3


@pytest.mark.mpi
def test_resume_from_checkpoint_continues_exactly(mpi, tmp_path):
    run = mpi("layer_parallel.py", 3, "checkpoint", str(tmp_path / "ck"), timeout=120)
    assert run.returncode == 0, run.stderr
    for rank, rep in run.by_rank().items():
        res = rep["results"]
        assert res["resume"]["difference"] == 0.0
        assert res["resume"]["extra"] == {"step": 2}
        assert res["resume"]["files"] == [f"rank{r:05d}-of-00003.pt" for r in range(3)]
        assert "num_steps is 16 there and 15 here" in res["refused"]


@pytest.mark.mpi
def test_batch_shapes_that_differ_between_ranks_fail_everywhere(mpi):
    run = mpi("layer_parallel.py", 3, "bad-batch", timeout=60)
    assert run.returncode == 0, run.stderr
    for rep in run.by_rank().values():
        assert "input batch shape and dtype, whether it requires grad, and context inputs differ between ranks" in rep["results"]["error"]


def test_no_grad_forward_does_not_disturb_the_pending_backward():
    model, serial = build("dense", 12, mgrit.Config(levels=1), mgrit.Config(levels=1))
    x, y = data("dense", 4)
    loss = nn.functional.cross_entropy(model(x), y)
    with torch.no_grad():
        model(torch.randn(4, 5, dtype=torch.float64))
    loss.backward()
    nn.functional.cross_entropy(serial(x), y).backward()
    assert relative(owned_pairs(model, serial, grad=True)) <= 1e-12


def test_backward_through_a_stale_forward_is_refused():
    model, _ = build("dense", 12, mgrit.Config(levels=1), mgrit.Config(levels=1))
    x, y = data("dense", 4)
    first = nn.functional.cross_entropy(model(x), y)
    nn.functional.cross_entropy(model(x), y)
    with pytest.raises(RuntimeError, match="older forward pass"):
        first.backward()


def test_warm_start_reuses_the_previous_solution():
    warm = mgrit.Config(levels=3, coarsening=2, relax="FCF", tol=0.0, max_iter=1, min_coarse=1,
                        initial_guess="warm")
    model, _ = build("dense", 16, warm, warm)
    x, _ = data("dense", 4)
    with torch.no_grad():
        first = model(x)
        first_residual = model.stats["forward"]["residuals"][0]
        second = model(x)   # starts from the first solve's states: one more cycle's worth
        second_residual = model.stats["forward"]["residuals"][0]
    cold, _ = build("dense", 16, mgrit.Config(levels=1), mgrit.Config(levels=1))
    exact = cold(x).detach()
    assert (second - exact).norm() < 0.2 * (first - exact).norm()
    assert second_residual < 0.2 * first_residual


class _WrongShape(nn.Module):
    def forward(self, u):
        return u[..., :-1]


def _alternating_requires_grad():
    """Layers whose weights are trainable in every other layer only."""
    calls = []

    def factory():
        calls.append(1)
        return nn.Linear(8, 8).requires_grad_(len(calls) % 2 == 1)
    return factory


@pytest.mark.parametrize("factory,words", [
    (lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)),
     "BatchNorm1d with running statistics"),
    (_alternating_requires_grad(), "differs from layer 0 in its parameters"),
    (lambda: 3, "must return an nn.Module"),
])
def test_bad_step_modules_are_refused_at_construction(factory, words):
    with pytest.raises((ValueError, TypeError), match=words):
        mgrit.LayerParallel(factory, 8, forward=mgrit.Config(levels=1),
                            backward=mgrit.Config(levels=1))


def test_step_that_changes_the_shape_is_named():
    model = mgrit.LayerParallel(_WrongShape, 8, forward=mgrit.Config(levels=1),
                                backward=mgrit.Config(levels=1))
    with pytest.raises(ValueError, match=r"maps a state of shape \(2, 8\).*same shape"):
        model(torch.randn(2, 8))


@pytest.mark.parametrize("levels,coarsening,words", [(3, 4, "too small"), (5, 2, "too small")])
def test_too_few_layers_for_the_hierarchy(levels, coarsening, words):
    with pytest.raises(ValueError, match=words):
        mgrit.LayerParallel(lambda: nn.Linear(4, 4), 8,
                            forward=mgrit.Config(levels=levels, coarsening=coarsening))


@pytest.mark.parametrize("kind", ["dense", "conv", "gelu"])
def test_batched_and_loop_execution_give_the_same_training_step(kind):
    """One vmapped/stacked call per sub-step against one call per interval, forward and
    adjoint, float64, inexact settings (so both paths are really exercised)."""
    grads = {}
    for execution in ("loop", "batched"):
        fwd = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=2,
                           min_coarse=1, execution=execution)
        bwd = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=1,
                           min_coarse=1, execution=execution)
        model, _ = build(kind, 16, fwd, bwd)
        assert (model.layers.chain is None) == (kind == "gelu")
        x, y = data(kind, 4)
        nn.functional.cross_entropy(model(x), y).backward()
        grads[execution] = [p.grad.clone() for p in model.parameters()]
        grads[execution + "-stats"] = model.stats
    assert len(grads["loop"]) == len(grads["batched"]) > 0
    for a, b in zip(grads["loop"], grads["batched"]):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    for kind_ in ("forward", "backward"):
        la, lb = grads["loop-stats"][kind_]["residuals"], grads["batched-stats"][kind_]["residuals"]
        assert la == pytest.approx(lb, rel=1e-12)


def test_modules_outside_the_kernels_match_serial_autograd():
    exact = mgrit.Config(levels=1)
    model, serial = build("gelu", 10, exact, exact)
    x, y = data("gelu", 4)
    nn.functional.cross_entropy(model(x), y).backward()
    nn.functional.cross_entropy(serial(x), y).backward()
    assert relative(owned_pairs(model, serial, grad=True)) <= 1e-12


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_backward_reuses_the_forward_outputs_with_the_same_gradients(kind, monkeypatch):
    """The final fine sweep of the forward solve keeps every layer's op outputs; the
    adjoint's VJPs take them instead of evaluating f again: fewer evaluations, the same
    gradients (to rounding: a coarse step may take values a batched kernel computed where
    it would compute them singly), and nothing kept once the backward pass is done."""
    from mgrit.kernels import chain as kernels
    from mgrit.nn.engine.propagators import NetworkPropagator

    fwd = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=2,
                       min_coarse=1)
    bwd = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=1,
                       min_coarse=1)
    runs = {}
    for reuse in (True, False):
        if not reuse:   # the forward pass keeps nothing: every VJP evaluates f again
            monkeypatch.setattr(NetworkPropagator, "final_sweep", lambda self, active: None)
        model, _ = build(kind, 16, fwd, bwd)
        x, y = data(kind, 4)
        loss = nn.functional.cross_entropy(model(x), y)
        calls = []
        original = kernels.Chain._run
        monkeypatch.setattr(kernels.Chain, "_run",
                            lambda self, t, v: calls.append(1) or original(self, t, v))
        loss.backward()
        monkeypatch.setattr(kernels.Chain, "_run", original)
        kept = [s.prop.outputs for s in model._passes.forward_solvers.values()]
        runs[reuse] = ([p.grad.clone() for p in model.parameters()], len(calls), kept)
    (grads, evals, kept), (grads_plain, evals_plain, _) = runs[True], runs[False]
    assert relative(list(zip(grads, grads_plain))) <= 1e-13
    assert evals < evals_plain
    assert kept == [{}]


@pytest.mark.parametrize("kind", ["dense", "conv", "gelu"])
@pytest.mark.parametrize("cycles", [1, 0])
def test_parameter_gradients_are_the_layer_vjps_at_the_final_adjoint_states(kind, cycles):
    """With an inexact backward solve (one cycle, or none from a nested start), every
    layer's parameter gradient is h (df/dtheta)(u_n)^T w_{n+1} at the solves' final
    fine-level states (forward u_n, adjoint w_{n+1}): checked against serial autograd
    through each layer alone, and the solve is indeed inexact (the gradient is not serial
    autograd's)."""
    config = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0,
                          max_iter=cycles, min_coarse=1,
                          initial_guess="nested" if cycles == 0 else "zero")
    model, serial = build(kind, 16, config, config)
    x, y = data(kind, 4)
    nn.functional.cross_entropy(model(x), y).backward()
    nn.functional.cross_entropy(serial(x), y).backward()
    assert relative(owned_pairs(model, serial, grad=True)) > 1e-6
    forward = next(s for key, s in model._passes.forward_solvers.items() if key[3])
    adjoint = next(iter(model._passes.adjoint_solvers.values()))
    u, u_offset = forward.fine_states()
    w, w_offset = adjoint.fine_states()
    h = model.h
    for n in range(16):
        layer = serial[n + 1].f
        layer.zero_grad()
        u_n = u[n - u_offset].detach()
        w_next = w[16 - 1 - n - w_offset]           # reversed numbering: point N - (n + 1)
        (layer(u_n) * w_next).sum().mul(h).backward()
        for name, param in layer.named_parameters():
            mine = model.layers.params[name.replace(".", "__")].grad[n]
            assert torch.allclose(mine, param.grad, rtol=1e-12, atol=1e-14), (n, name)


@pytest.mark.parametrize("seed", range(7))
def test_recorded_gradients_are_the_row_by_row_products_whatever_the_batches_layout(seed):
    """Assembled gradients equal (to the bit) each recorded row times its step size, the
    later entry of a layer recorded twice counting, for batches that are progressions
    either way, the F-points of whole intervals (a strided grid, also with a few rows
    before and after it, as a rank records the end of an interval begun on the rank
    before), or any order (an index); again when the same batch lists come back (a reused
    plan) with new cotangents."""
    g = torch.Generator().manual_seed(seed)
    model, _ = build("dense", 16)
    stack = model.layers
    names = stack.names
    shapes = {n: stack.params[n.replace(".", "__")].shape[1:] for n in names}
    layouts = [
        [list(range(16))],                                               # one progression
        [[c + k for c in range(0, 16, 4) for k in (1, 2, 3)], list(range(0, 16, 4))],
        [list(range(15, -1, -2)), list(range(14, -1, -2))],             # descending
        [torch.randperm(16, generator=g).tolist()],                     # any order
        [[c + k for c in range(0, 16, 4) for k in (1, 2, 3)] + [0, 4, 8, 12]],  # no grid
        [list(range(16)), [5, 3, 4], [9]],                              # layers recorded twice
        [[0] + [c + k for c in (1, 5, 9) for k in (1, 2, 3)] + [14, 15], [1, 5, 9, 13]],
    ]
    kinds = [["slice"], ["grid", "slice"], ["slice", "slice"], ["index"], ["index"],
             ["slice", "index", "slice"], ["slice", "grid", "slice", "slice"]]
    batches = layouts[seed]
    dts = [0.25, 0.5, 0.75][:len(batches)] if seed == 5 else [0.375] * len(batches)
    indices = None
    for _ in range(2):          # the second time the plan of the first is reused
        recorded = [(batch, {n: torch.randn(len(batch), *shapes[n], dtype=torch.float64,
                                            generator=g) for n in names}, dt)
                    for batch, dt in zip(batches, dts)]
        grads = gradients.layer_gradients(stack, recorded)
        # an index goes to the states' device once, not at every pass (in a captured
        # step that copy would be a host transfer)
        kept = list(gradients._PLANS[stack]._indices.values())
        assert indices is None or all(a is b for a, b in zip(kept, indices))
        indices = kept
        for n in names:
            expected = torch.empty(16, *shapes[n], dtype=torch.float64)
            for batch, cotangents, dt in recorded:
                for i, layer in enumerate(batch):
                    expected[layer] = dt * cotangents[n][i]
            assert torch.equal(grads[n], expected), (seed, n)
        assert [place[0] for place in gradients._PLANS[stack].places] == kinds[seed]
        assert len(indices) == kinds[seed].count("index")


def test_recorded_gradients_take_a_layers_later_entry_and_name_layers_never_reached():
    config = mgrit.Config(levels=2, coarsening=2)
    model, _ = build("dense", 4, config, config)
    names = model.layers.names
    shapes = {n: model.layers.params[n.replace(".", "__")].shape[1:] for n in names}

    def entry(layers, value, dt=0.5):
        return layers, {n: torch.full((len(layers), *shapes[n]), value, dtype=torch.float64)
                        for n in names}, dt

    grads = gradients.layer_gradients(model.layers, [entry([3, 2, 1, 0], 1.0), entry([2], 3.0)])
    for n in names:
        got = grads[n].flatten(1)[:, 0].tolist()
        assert got == [0.5, 0.5, 1.5, 0.5], n
    with pytest.raises(RuntimeError, match=r"did not reach layers \[0, 2\]"):
        gradients.layer_gradients(model.layers, [entry([3, 1], 1.0)])


def test_stacked_layer_batches_follow_updates_and_conversions():
    """Batches of the stacked layers, ascending (the forward's) and descending (the
    adjoint's, views of a reversed copy), hold exactly the layers asked for, and still do
    after an in-place update (an optimizer step) and after a dtype conversion."""
    model, _ = build("dense", 16)
    stack = model.layers
    batches = [(3, 4, 3), (0, 1, 16), (15, -1, 4), (14, -4, 3), (15, -5, 4), (7, -1, 1)]

    def check():
        for start, stride, count in batches:
            got = stack.rows(start, stride, count)
            for name in stack.names:
                full = stack.params[name.replace(".", "__")].detach()
                want = torch.stack([full[start + i * stride] for i in range(count)])
                assert got[name].dtype == full.dtype
                assert torch.equal(got[name], want), (start, stride, count, name)

    check()
    with torch.no_grad():
        for p in stack.params.values():
            p.mul_(1.5).add_(0.25)
    check()
    model.float()
    check()


class _Forgetful(dict):
    """A cache that never holds anything."""

    def __setitem__(self, key, value):
        pass

    def update(self, *args, **kwargs):
        pass


@pytest.mark.parametrize("execution", ["batched", "loop"])
@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_coarse_adjoint_steps_evaluate_f_once_per_backward_solve(kind, execution,
                                                                monkeypatch):
    """A coarse adjoint step linearises at a forward state that is fixed for the whole
    backward solve. Where the forward pass kept no op outputs for its layer, they are
    computed at the step's first use and reused at the next (F-relaxation before and after
    the coarse correction, C-relaxation, the residual): fewer evaluations, the same
    gradients to rounding. (Step by step, kernels="kernels": the evaluations are
    counted in torch's chain kernels, which compiled phases do not call.)"""
    from mgrit.kernels import chain as kernels
    from mgrit.nn.engine.adjoint import AdjointPropagator
    from mgrit.nn.engine.propagators import NetworkPropagator

    monkeypatch.setattr(NetworkPropagator, "final_sweep", lambda self, active: None)
    fwd = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=2,
                       min_coarse=1, execution=execution)
    bwd = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=2,
                       min_coarse=1, execution=execution)
    runs = {}
    for reuse in (True, False):
        if not reuse:   # nothing cached: every VJP evaluates f again
            begin = AdjointPropagator.begin

            def forgetful_begin(self):
                begin(self)
                self._computed = _Forgetful()
            monkeypatch.setattr(AdjointPropagator, "begin", forgetful_begin)
        model, _ = build(kind, 16, fwd, bwd, kernels="kernels")
        x, y = data(kind, 4)
        loss = nn.functional.cross_entropy(model(x), y)
        calls = []
        run, single = kernels.Chain._run, kernels.Chain.single
        monkeypatch.setattr(kernels.Chain, "_run",
                            lambda self, t, v: calls.append(1) or run(self, t, v))
        monkeypatch.setattr(kernels.Chain, "single",
                            lambda self, t, v, keep=None: calls.append(1) or
                            single(self, t, v, keep))
        loss.backward()
        monkeypatch.setattr(kernels.Chain, "_run", run)
        monkeypatch.setattr(kernels.Chain, "single", single)
        runs[reuse] = ([p.grad.clone() for p in model.parameters()], len(calls))
    (grads, evals), (grads_plain, evals_plain) = runs[True], runs[False]
    assert relative(list(zip(grads, grads_plain))) <= 1e-13
    assert 0 < evals < evals_plain


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_an_adjoint_batch_with_one_nonzero_entry_takes_the_single_step(kind, monkeypatch):
    """A batch of adjoint states of which one is non-zero (the front of a first backward
    cycle) gives that entry its VJP through the single-step path, zeros elsewhere: the same
    numbers as autograd on the layer. (With torch's chain kernels: the native ones take a
    whole batch in C, zero entries included.)"""
    from mgrit.core.propagator import StepBatch
    from mgrit.kernels.strategies import ChainSteps
    from mgrit.nn.engine.adjoint import AdjointPropagator

    model, _ = build(kind, 16, kernels="torch-steps")
    x, _ = data(kind, 4)
    shape = model.opening(x).shape
    gen = torch.Generator().manual_seed(3)
    states = torch.randn(17, *shape, generator=gen, dtype=torch.float64)
    prop = AdjointPropagator(model.layers, 16, [1, 2, 4], states, 0)
    prop.begin()
    assert type(prop.kernels) is ChainSteps
    singles = []
    single = ChainSteps.vjp_single_into
    monkeypatch.setattr(ChainSteps, "vjp_single_into",
                        lambda self, p, *args: singles.append(p) or single(self, p, *args))
    batch = StepBatch(1, 1, 2, 3, 2, 0.0, 1 / 16)        # level 1, steps 1, 3, 5
    ws = torch.zeros(3, *shape, dtype=torch.float64)
    ws[1] = torch.randn(shape, generator=gen, dtype=torch.float64)
    out = prop.step_batch(ws, batch)
    p = prop._layer_point(batch[1])
    assert singles == [p]
    u = states[p].clone().requires_grad_()
    with torch.enable_grad():
        ref = ws[1] + batch.dt * torch.autograd.grad(model.layers.module(p)(u), u, ws[1])[0]
    assert torch.allclose(out[1], ref, rtol=1e-12, atol=1e-14)
    assert not out[0].any() and not out[2].any()


def test_default_solver_settings_are_those_of_training():
    """LayerParallel's defaults come from mgrit.nn.defaults: 3 levels, coarsening 4, F on
    the fine level and FCF below, 2 forward and 1 backward cycle, coarsening to one step."""
    from mgrit.nn.defaults import training_config

    model = mgrit.LayerParallel(lambda: torch.nn.Linear(2, 2), 16)
    for direction, cycles in (("forward", 2), ("backward", 1)):
        expected = mgrit.Config(levels=3, coarsening=4, relax=("F", "FCF"), tol=0.0,
                                max_iter=cycles, min_coarse=1)
        assert training_config(direction) == expected
        assert getattr(model, f"{direction}_config") == expected
    assert training_config("forward", levels=4).relax == ("F", "FCF", "FCF")
    assert training_config("forward", levels=1).levels == 1
    with pytest.raises(ValueError, match="direction='sideways' is not valid"):
        training_config("sideways")


def test_warm_starts_change_both_solves_and_bring_them_closer():
    """initial_guess="warm" starts the forward and the adjoint solve from the previous
    step's states: on the second pass over the same batch at the same weights, both solves
    start nearer the solution, their residuals are smaller than a cold start's, and the
    output and gradients are closer to the exact ones."""
    from nets import inexact_config

    x, y = data("dense", 4)
    exact, _ = build("dense", 16, mgrit.Config(levels=1), mgrit.Config(levels=1))
    xe = x.clone().requires_grad_()
    out_exact = exact(xe)
    nn.functional.cross_entropy(out_exact, y).backward()
    out_exact = out_exact.detach()
    errors = {}
    for warm in (False, True):
        model, _ = build("dense", 16, inexact_config(3, 2, warm), inexact_config(3, 1, warm))
        for _ in range(2):
            model.zero_grad()
            xa = x.clone().requires_grad_()
            out = model(xa)
            nn.functional.cross_entropy(out, y).backward()
        errors[warm] = {"output": float((out.detach() - out_exact).norm() / out_exact.norm()),
                        "input_grad": float((xa.grad - xe.grad).norm() / xe.grad.norm()),
                        "forward": model.stats["forward"]["residuals"][-1],
                        "backward": model.stats["backward"]["residuals"][-1]}
    for key in ("output", "input_grad", "forward", "backward"):
        assert errors[True][key] < 0.5 * errors[False][key], (key, errors)


def _dense_on_ranks(comm, opening):
    torch.manual_seed(3)
    config = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), max_iter=2, tol=0.0,
                          min_coarse=1)
    return mgrit.LayerParallel(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh()), 12, 1.0,
                               forward=config, backward=config, comm=comm, opening=opening,
                               closing=nn.Linear(4, 2)).double()


@pytest.mark.parametrize("ranks", [1, 3])
def test_the_backward_pass_sends_dl_du0_only_where_something_needs_it(ranks):
    """Without an opening layer or an input that requires grad, the adjoint solve's final
    state (dL/du0) is not sent: its fixed-cycle solve ends with a reduction of its residual
    norms alone, where with an input that requires grad the state goes with them in the
    same reduction (no broadcast either way), and the parameter gradients are the same to
    the bit (the input's gradient equal on every rank)."""
    from mgrit.comm.tracing import Tracer, TracingComm

    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 1, 0, 1])

    def program(comm, needs):
        tracer = Tracer()
        model = _dense_on_ranks(TracingComm(comm, tracer), None)
        given = x.clone().requires_grad_(needs)
        loss = nn.functional.cross_entropy(model(given), y)
        tracer.start()
        loss.backward()
        events = tracer.stop()
        collectives = [(e[1], e[4]) for e in events if e[0] == "collective"]
        return collectives, [p.grad.clone() for p in model.parameters()], given.grad

    without = run_ranks(ranks, lambda comm: program(comm, False))
    with_input = run_ranks(ranks, lambda comm: program(comm, True))
    state = 5 * 4 * 8                    # dL/du0: the batch's states, float64
    for (c0, g0, x0), (c1, g1, x1) in zip(without, with_input):
        assert x0 is None and x1 is not None
        if ranks > 1:
            assert [op for op, _ in c0] == [op for op, _ in c1] and "bcast" not in dict(c1)
            assert c1[-1] == ("allreduce", c0[-1][1] + state), (c0, c1)
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))
        assert torch.equal(x1, with_input[0][2])


def test_ranks_that_differ_on_whether_the_input_requires_grad_fail_everywhere():
    x = torch.randn(5, 4, dtype=torch.float64)

    def program(comm):
        model = _dense_on_ranks(comm, None)
        model(x.clone().requires_grad_(comm.rank == 1))

    with pytest.raises(ValueError, match="whether it requires grad"):
        run_ranks(3, program)
