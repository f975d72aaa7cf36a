"""A pre-norm transformer block as a residual step, with a batched fast path.

`TransformerBlock` is the residual function of a GPT- or ViT-style block: with
a = drop(proj(attention(norm1(u)))) and m(v) = drop(fc2(gelu(fc1(norm2(v))))),

    f(u) = a + m(u + a),

so that u + f(u) is the usual block's output and u + h f(u) its step of size h. Its
`forward_batched` advances a batch of layers (MGRIT's intervals) in one call: the linear
maps as batched matrix products over the layers' stacked weights, the attention of all
layers and samples in one `scaled_dot_product_attention` call over the flattened
(layer, sample) batch. `LayerParallel` uses it instead of `vmap`, which has no batching
rule for fused attention and falls back to per-sample loops. Dropout draws are keyed
(`mgrit.nn.draws`), so each layer drops the same elements in every evaluation of a
training step.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .engine import randomness as draws

NORMS = ("layer", "rms")


class TransformerBlock(nn.Module):
    """The residual of a pre-norm transformer block on states (batch, tokens, width).

    width, heads: model width and attention heads (width divisible by heads).
    hidden:       the MLP's hidden width (default 4 * width).
    dropout:      dropout probability of the attention and MLP outputs (keyed draws).
    causal:       each token attends to itself and earlier tokens only.
    norm:         "layer" (LayerNorm) or "rms" (RMSNorm, no bias).

    Context inputs (keyword arguments of `forward`, constant over depth): `attn_mask`, a
    boolean mask (True: may attend) or an additive float mask of shape (tokens, tokens),
    (batch, tokens, tokens) or (batch, heads, tokens, tokens), combined with `causal`.
    """

    def __init__(self, width: int, heads: int, hidden: int | None = None,
                 dropout: float = 0.0, causal: bool = False, norm: str = "layer",
                 eps: float = 1e-5) -> None:
        super().__init__()
        if width < 1 or heads < 1 or width % heads:
            raise ValueError(f"width ({width}) must be a positive multiple of heads ({heads})")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        hidden = 4 * width if hidden is None else hidden
        self.width, self.heads, self.hidden = width, heads, hidden
        self.causal, self.norm, self.eps, self.p = causal, norm, eps, float(dropout)
        make_norm = ((lambda: nn.LayerNorm(width, eps=eps)) if norm == "layer"
                     else (lambda: nn.RMSNorm(width, eps=eps)))
        self.norm1 = make_norm()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = make_norm()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.drop = draws.Dropout(dropout)

    def extra_repr(self) -> str:
        return (f"width={self.width}, heads={self.heads}, hidden={self.hidden}, "
                f"dropout={self.p}, causal={self.causal}, norm={self.norm!r}")

    def forward(self, u: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        # by attribute: LayerParallel's per-layer modules hold views, not parameters
        params = {f"{mod}.{attr}": getattr(getattr(self, mod), attr)[None]
                  for mod in ("norm1", "qkv", "proj", "norm2", "fc1", "fc2")
                  for attr in ("weight", "bias")
                  if getattr(getattr(self, mod), attr, None) is not None}
        key = draws.active()
        if key is not None and key.dim() == 0:
            key = key.reshape(1)
        with draws.keyed(key) if key is not None else contextlib.nullcontext():
            return self.forward_batched(params, u[None], attn_mask=attn_mask)[0]

    def forward_batched(self, t: dict[str, Tensor], u: Tensor,
                        attn_mask: Tensor | None = None) -> Tensor:
        """f for K layers at once: t maps parameter names to (K, ...) stacked tensors, u is
        (K, batch, tokens, width); draws take the active keys, one per layer."""
        k, width = u.shape[0], self.width
        shape = u.shape
        tokens = shape[-2]
        x = u.reshape(k, -1, tokens, width)
        batch = x.shape[1]
        h = self._norm(x, t, "norm1")
        qkv = _linear(h, t["qkv.weight"], t["qkv.bias"])
        heads, dh = self.heads, width // self.heads
        q, kk, v = (y.reshape(k * batch, tokens, heads, dh).transpose(1, 2)
                    for y in qkv.split(width, dim=-1))
        mask = self._mask(attn_mask, k, batch, tokens, u)
        o = F.scaled_dot_product_attention(q, kk, v, attn_mask=mask,
                                           is_causal=self.causal and mask is None,
                                           scale=1.0 / math.sqrt(dh))
        o = o.transpose(1, 2).reshape(k, batch, tokens, width)
        a = draws.dropout(_linear(o, t["proj.weight"], t["proj.bias"]), self.p, self.training)
        h2 = self._norm(x + a, t, "norm2")
        m = _linear(F.gelu(_linear(h2, t["fc1.weight"], t["fc1.bias"])),
                    t["fc2.weight"], t["fc2.bias"])
        m = draws.dropout(m, self.p, self.training)
        return (a + m).reshape(shape)

    def _norm(self, x: Tensor, t: dict[str, Tensor], name: str) -> Tensor:
        w = t[name + ".weight"][:, None, None, :]
        if self.norm == "layer":
            y = F.layer_norm(x, (self.width,), eps=self.eps)
            return torch.addcmul(t[name + ".bias"][:, None, None, :], y, w)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def _mask(self, attn_mask: Tensor | None, k: int, batch: int, tokens: int,
              like: Tensor) -> Tensor | None:
        """attn_mask (with `causal`) for the flattened (layer, sample) batch, or None."""
        if attn_mask is None:
            return None
        mask = attn_mask
        if mask.dim() == 3:
            mask = mask[:, None]
        if mask.dim() == 4:
            if mask.shape[0] != batch:
                raise ValueError(f"attn_mask has {mask.shape[0]} samples, the state {batch}")
            mask = mask[None].expand(k, *mask.shape).reshape(k * batch, *mask.shape[1:])
        elif mask.dim() != 2:
            raise ValueError(f"attn_mask must have 2, 3 or 4 dimensions, got {mask.dim()}")
        if self.causal:
            causal = torch.ones(tokens, tokens, dtype=torch.bool, device=like.device).tril()
            if mask.dtype == torch.bool:
                mask = mask & causal
            else:
                mask = mask.masked_fill(~causal, float("-inf"))
        return mask


def _linear(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """x (K, ..., in) times each layer's weight (K, out, in) plus bias (K, out)."""
    k = x.shape[0]
    flat = x.reshape(k, -1, x.shape[-1])
    y = torch.baddbmm(bias[:, None, :], flat, weight.transpose(1, 2))
    return y.reshape(*x.shape[:-1], weight.shape[1])
