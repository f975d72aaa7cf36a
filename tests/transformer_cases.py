"""Residual networks with context inputs and dropout, built twice (layer-parallel and
plain), and training both side by side with the same random draws.

Cases:
- "block": `mgrit.nn.TransformerBlock` (causal, dropout 0.1, the batched fast path) with a
  per-sample boolean attention mask as context;
- "mlp": an MLP step with LayerNorm and dropout that takes a conditioning input `cond`
  (a context tensor that requires grad: its gradient is compared too);
- "encoder": torch's own nn.TransformerEncoderLayer with its default dropout (attention
  dropout draws from torch's generator: the layer-by-layer seeded path) and a boolean
  `src_mask` as context.
"""

import torch
from torch import nn

import mgrit
from mgrit.nn import TransformerBlock, draws

WIDTH, TOKENS, BATCH, FEATURES = 8, 5, 3, 4


class ConditionedMLP(nn.Module):
    """f(u, cond) = drop(W2 tanh(W1 LN(u) + cond))."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.2)

    def forward(self, u, cond):
        return self.drop(self.fc2(torch.tanh(self.fc1(self.norm(u)) + cond)))


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, 2)

    def forward(self, u):
        return self.out(u.mean(dim=-2) if u.dim() == 3 else u)


def _parts(case: str):
    if case == "block":
        return (nn.Linear(FEATURES, WIDTH), Pool(),
                lambda: TransformerBlock(WIDTH, 2, 2 * WIDTH, dropout=0.1, causal=True))
    if case == "mlp":
        return nn.Linear(FEATURES, WIDTH), Pool(), ConditionedMLP
    if case == "encoder":
        return (nn.Linear(FEATURES, WIDTH), Pool(),
                lambda: nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, batch_first=True))
    raise ValueError(case)


def inputs(case: str, seed: int = 3):
    """(x, targets, context) in float64; the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    if case == "mlp":
        x = torch.randn(BATCH, FEATURES, generator=gen, dtype=torch.float64)
        context = {"cond": torch.randn(BATCH, 2 * WIDTH, generator=gen,
                                       dtype=torch.float64).requires_grad_()}
    else:
        x = torch.randn(BATCH, TOKENS, FEATURES, generator=gen, dtype=torch.float64)
        if case == "block":
            mask = torch.rand(BATCH, TOKENS, TOKENS, generator=gen) > 0.3
            mask |= torch.eye(TOKENS, dtype=torch.bool)
            context = {"attn_mask": mask}
        else:
            # torch's convention here: True = may not attend
            mask = torch.rand(TOKENS, TOKENS, generator=gen) > 0.7
            context = {"src_mask": mask & ~torch.eye(TOKENS, dtype=torch.bool)}
    y = torch.randint(0, 2, (BATCH,), generator=gen)
    return x, y, context


def build(case: str, num_steps: int, config: mgrit.Config, comm=None, seed: int = 1):
    """(layer-parallel model, plain network) with the same initial weights and draws."""
    torch.manual_seed(seed)
    opening, closing, step = _parts(case)
    model = mgrit.LayerParallel(step, num_steps, 1.0, forward=config, backward=config,
                                comm=comm, opening=opening, closing=closing, seed=11)
    torch.manual_seed(seed)
    opening, closing, step = _parts(case)
    serial = mgrit.serial_resnet(step, num_steps, 1.0, opening, closing)
    return model.double(), serial.double()


def _layer_pairs(model, serial):
    lo, hi = model.layer_range
    for name in model.layers.names:
        stacked = model.layers.params[name.replace(".", "__")]
        for n in range(lo, hi + 1):
            yield stacked, n - lo, serial[n + 1].f.get_parameter(name)


def _relative(a, b) -> float:
    scale = float(b.norm())
    return float((a - b).norm()) / scale if scale else float((a - b).norm())


def train_side_by_side(case: str, num_steps: int, config: mgrit.Config, steps: int = 2,
                       comm=None) -> dict:
    """Train both forms `steps` SGD steps on the same batch; the largest relative
    difference over the steps of: outputs, input gradients, context gradients, every
    owned layer's parameter gradient (row by row), and the parameters after training.
    Also whether dropout was active (outputs differ from the eval-mode output)."""
    model, serial = build(case, num_steps, config, comm)
    x, y, context = inputs(case)
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(serial.parameters(), lr=0.1)
    worst = {"output": 0.0, "input_grad": 0.0, "context_grad": 0.0, "param_grad": 0.0}
    for k in range(steps):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ca = {n: (v.detach().clone().requires_grad_() if v.requires_grad else v)
              for n, v in context.items()}
        cb = {n: (v.detach().clone().requires_grad_() if v.requires_grad else v)
              for n, v in context.items()}
        opt_a.zero_grad()
        opt_b.zero_grad()
        out = model(xa, **ca)
        nn.functional.cross_entropy(out, y).backward()
        with draws(model.draw_seed, k):
            ref = serial(xb, **cb)
        nn.functional.cross_entropy(ref, y).backward()
        worst["output"] = max(worst["output"], _relative(out.detach(), ref.detach()))
        worst["input_grad"] = max(worst["input_grad"], _relative(xa.grad, xb.grad))
        for n in ca:
            if ca[n].requires_grad:
                worst["context_grad"] = max(worst["context_grad"],
                                            _relative(ca[n].grad, cb[n].grad))
        for stacked, row, param in _layer_pairs(model, serial):
            worst["param_grad"] = max(worst["param_grad"],
                                      _relative(stacked.grad[row], param.grad))
        opt_a.step()
        opt_b.step()
    worst["params_after"] = max(_relative(stacked[row].detach(), param.detach())
                                for stacked, row, param in _layer_pairs(model, serial))
    plain_context = {n: v.detach() for n, v in context.items()}
    with torch.no_grad():
        noisy = model(x, **plain_context)
        model.eval()
        plain = model(x, **plain_context)
        model.train()
    worst["layers"] = list(model.layer_range)
    worst["draw_step"] = model.draw_step
    worst["dropout_active"] = bool((plain - noisy).abs().max() > 1e-6)
    return worst
