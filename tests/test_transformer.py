"""Any residual block as a time step: context inputs, keyed random draws (dropout) and the
batched transformer block, against serial autograd and serial training."""

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import mgrit
from mgrit.nn import Dropout, TransformerBlock, draws, layer_key
from mgrit.nn.engine import randomness

sys.path.insert(0, str(Path(__file__).parent))
from transformer_cases import build, inputs, train_side_by_side  # noqa: E402

EXACT = mgrit.Config(levels=1)
CONVERGED = mgrit.Config(levels=3, coarsening=2, relax="FCF", tol=1e-13, max_iter=60,
                         min_coarse=1)
# float64 round-off over a few layers and two SGD steps
TOL = 1e-12


# the block against torch's own layer --------------------------------------------------------

def _copy_into_encoder(block: TransformerBlock, layer: nn.TransformerEncoderLayer) -> None:
    with torch.no_grad():
        layer.self_attn.in_proj_weight.copy_(block.qkv.weight)
        layer.self_attn.in_proj_bias.copy_(block.qkv.bias)
        layer.self_attn.out_proj.weight.copy_(block.proj.weight)
        layer.self_attn.out_proj.bias.copy_(block.proj.bias)
        layer.linear1.weight.copy_(block.fc1.weight)
        layer.linear1.bias.copy_(block.fc1.bias)
        layer.linear2.weight.copy_(block.fc2.weight)
        layer.linear2.bias.copy_(block.fc2.bias)
        for mine, theirs in ((block.norm1, layer.norm1), (block.norm2, layer.norm2)):
            theirs.weight.copy_(mine.weight)
            theirs.bias.copy_(mine.bias)


@pytest.mark.parametrize("causal", [False, True])
def test_block_is_the_residual_of_torchs_pre_norm_encoder_layer(causal):
    torch.manual_seed(0)
    block = TransformerBlock(12, 3, 20, causal=causal).double()
    layer = nn.TransformerEncoderLayer(12, 3, 20, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True).double()
    _copy_into_encoder(block, layer)
    u = torch.randn(4, 6, 12, dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64) if causal else None
    expected = layer(u, src_mask=mask, is_causal=causal)
    assert torch.allclose(u + block(u), expected, rtol=0, atol=1e-13)


def test_batched_block_equals_the_block_layer_by_layer():
    torch.manual_seed(0)
    blocks = [TransformerBlock(8, 2, dropout=0.3, causal=True, norm=norm).double()
              for norm in ("layer", "layer", "layer")]
    u = torch.randn(3, 2, 5, 8, dtype=torch.float64)
    stacked = {name: torch.stack([dict(b.named_parameters())[name] for b in blocks])
               for name, _ in blocks[0].named_parameters()}
    keys = torch.tensor([7, 8, 9])
    with randomness.keyed(keys):
        together = blocks[0].forward_batched(stacked, u)
    for i, b in enumerate(blocks):
        with randomness.keyed(keys[i]):
            alone = b(u[i])
        assert torch.allclose(together[i], alone, rtol=0, atol=1e-14)


def test_rms_norm_block_normalises_by_the_root_mean_square():
    torch.manual_seed(0)
    block = TransformerBlock(8, 2, norm="rms").double()
    assert isinstance(block.norm1, nn.RMSNorm)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    params = {n: p[None] for n, p in block.named_parameters()}
    got = block._norm(x[None], params, "norm1")[0]
    assert torch.allclose(got, block.norm1(x), rtol=0, atol=1e-14)


# keyed draws --------------------------------------------------------------------------------

def test_draws_do_not_depend_on_the_batch_a_layer_is_evaluated_in():
    keys = torch.tensor([layer_key(5, 2, n) for n in range(4)])
    together = randomness.uniform(keys, 1, (3, 7), torch.device("cpu"))
    for n in range(4):
        alone = randomness.uniform(keys[n], 1, (3, 7), torch.device("cpu"))
        assert torch.equal(together[n], alone)
    # other layers, steps and sites draw other numbers
    assert not torch.equal(together[0], together[1])
    other_site = randomness.uniform(keys[0], 2, (3, 7), torch.device("cpu"))
    assert not torch.equal(together[0], other_site)
    assert layer_key(5, 2, 0) != layer_key(5, 3, 0) != layer_key(6, 2, 0)


def test_keyed_draws_are_uniform():
    values = randomness.uniform(torch.tensor(123), 0, (200000,), torch.device("cpu"))
    assert 0.0 <= float(values.min()) and float(values.max()) < 1.0
    # mean and quartiles of U(0, 1), to several standard errors (about 6.5e-4)
    assert abs(float(values.mean()) - 0.5) < 3e-3
    for q in (0.25, 0.5, 0.75):
        assert abs(float((values < q).double().mean()) - q) < 4e-3


def test_dropout_keeps_the_expected_fraction_and_scales():
    layer = Dropout(0.25)
    x = torch.ones(100000, dtype=torch.float64)
    with randomness.keyed(3):
        y = layer(x)
    kept = y != 0
    assert abs(float(kept.double().mean()) - 0.75) < 5e-3
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.75))
    assert torch.equal(layer.eval()(x), x)


def test_dropout_modules_of_a_step_become_keyed():
    model = mgrit.LayerParallel(lambda: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)), 4,
                                forward=EXACT, backward=EXACT)
    assert isinstance(model.layers.template[1], Dropout)
    assert model.layers.keyed_random and not model.layers.torch_random


# training against serial ---------------------------------------------------------------------

@pytest.mark.parametrize("case", ["block", "mlp", "encoder"])
@pytest.mark.parametrize("config", [EXACT, CONVERGED], ids=["exact", "converged"])
def test_training_with_context_and_dropout_equals_serial_training(case, config):
    res = train_side_by_side(case, 7, config)
    assert res["dropout_active"], "dropout must draw in training mode"
    for key in ("output", "input_grad", "context_grad", "param_grad", "params_after"):
        assert res[key] < TOL, (key, res)
    assert res["draw_step"] == 3


def test_context_gradient_is_the_sum_over_layers():
    """dL/dcond against finite differences of the plain network (an independent check of
    the adjoint's context cotangents)."""
    model, serial = build("mlp", 5, CONVERGED)
    model.eval()   # no dropout: a deterministic function of cond
    x, y, context = inputs("mlp")
    cond = context["cond"].detach().clone().requires_grad_()
    nn.functional.cross_entropy(model(x, cond=cond), y).backward()
    serial.eval()
    base = cond.detach()
    eps = 1e-6
    for index in [(0, 0), (1, 5), (2, 15)]:
        plus, minus = base.clone(), base.clone()
        plus[index] += eps
        minus[index] -= eps
        with torch.no_grad():
            fd = (nn.functional.cross_entropy(serial(x, cond=plus), y)
                  - nn.functional.cross_entropy(serial(x, cond=minus), y)) / (2 * eps)
        assert abs(float(cond.grad[index]) - float(fd)) < 1e-8 * max(1.0, abs(float(fd)))


def test_no_grad_forward_between_keeps_the_backward_on_its_own_draws_and_context():
    model, serial = build("block", 6, EXACT)
    x, y, context = inputs("block")
    xa = x.clone().requires_grad_()
    out = model(xa, **context)
    with torch.no_grad():     # another pass: new draws, another mask
        model(x, attn_mask=torch.ones_like(context["attn_mask"]))
    nn.functional.cross_entropy(out, y).backward()
    xb = x.clone().requires_grad_()
    with draws(model.draw_seed, 0):
        nn.functional.cross_entropy(serial(xb, **context), y).backward()
    assert torch.allclose(xa.grad, xb.grad, rtol=1e-12, atol=1e-15)


def test_batched_transformer_step_emits_no_torch_warnings():
    torch.manual_seed(0)
    model = mgrit.LayerParallel(lambda: TransformerBlock(16, 4, dropout=0.1, causal=True), 16,
                                opening=nn.Linear(4, 16))
    x = torch.randn(2, 8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()
        model.eval()
        with torch.no_grad():
            model(x)


def test_eval_mode_does_not_drop():
    model, serial = build("block", 6, EXACT)
    x, _, context = inputs("block")
    model.eval()
    serial.eval()
    with torch.no_grad():
        a, b = model(x, **context), model(x, **context)
        ref = serial(x, **context)
    assert torch.equal(a, b)
    assert torch.allclose(a, ref, rtol=1e-13, atol=1e-14)


def test_checkpoint_continues_the_draws(tmp_path):
    model, _ = build("block", 6, EXACT)
    x, y, context = inputs("block")
    for _ in range(2):
        nn.functional.cross_entropy(model(x, **context), y).backward()
    model.save_checkpoint(tmp_path)
    with torch.no_grad():
        expected = model(x, **context)
    again, _ = build("block", 6, EXACT)
    again.load_checkpoint(tmp_path)
    assert again.draw_step == 2 and again.draw_seed == model.draw_seed
    with torch.no_grad():
        assert torch.equal(again(x, **context), expected)


# errors -------------------------------------------------------------------------------------

def test_context_that_is_not_a_tensor_is_refused():
    model, _ = build("block", 4, EXACT)
    x, _, _ = inputs("block")
    with pytest.raises(TypeError, match="context input 'causal' must be a tensor"):
        model(x, causal=True)


def test_step_module_without_the_context_argument_is_refused():
    model = mgrit.LayerParallel(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh()), 16)
    with pytest.raises(ValueError, match=r"does not take the context inputs \['mask'\]"):
        model(torch.randn(2, 4), mask=torch.ones(2, 4))


def test_block_refuses_bad_shapes():
    with pytest.raises(ValueError, match="multiple of heads"):
        TransformerBlock(10, 3)
    with pytest.raises(ValueError, match="norm must be one of"):
        TransformerBlock(8, 2, norm="batch")
    block = TransformerBlock(8, 2)
    with pytest.raises(ValueError, match="attn_mask has 4 samples, the state 2"):
        block(torch.randn(2, 3, 8), attn_mask=torch.ones(4, 3, 3, dtype=torch.bool))


# on several ranks ---------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_training_on_ranks_equals_serial_training(mpi, ranks):
    run = mpi("transformer.py", ranks, "train", "block,mlp,encoder", timeout=300)
    assert run.returncode == 0, run.stderr
    reports = run.by_rank()
    owned = sorted(tuple(rep["results"]["block-exact"]["layers"]) for rep in reports.values())
    assert owned[0][0] == 0 and owned[-1][1] == 6 and len(owned) == ranks
    for rep in reports.values():
        for name, res in rep["results"].items():
            assert res["dropout_active"], name
            for key in ("output", "input_grad", "context_grad", "param_grad", "params_after"):
                assert res[key] < TOL, (name, key, res)


@pytest.mark.mpi
def test_context_shapes_that_differ_between_ranks_fail_everywhere(mpi):
    run = mpi("transformer.py", 2, "bad-context", timeout=60)
    assert run.returncode == 0, run.stderr
    for rep in run.by_rank().values():
        assert "context inputs differ between ranks" in rep["results"]["error"]


@pytest.mark.mpi
def test_data_parallel_replicas_draw_different_masks(mpi):
    """Replicas hold different samples: the same batch on two replicas must not be dropped
    alike; replica 0 draws what one process with the same seed draws."""
    run = mpi("transformer.py", 2, "replicas", timeout=60)
    assert run.returncode == 0, run.stderr
    by_replica = {rep["results"]["replica"]: rep["results"] for rep in run.by_rank().values()}
    assert sorted(by_replica) == [0, 1]
    assert all(r["replicas_differ"] for r in by_replica.values())
    assert by_replica[0]["equals_one_process"] and not by_replica[1]["equals_one_process"]
