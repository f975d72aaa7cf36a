"""Random draws of stochastic layers that MGRIT can repeat.

MGRIT evaluates every layer several times in one training step (relaxations, cycles,
coarse levels, the adjoint), in batches whose makeup changes from call to call. A layer that
drew from torch's generator would see new random numbers at every evaluation, and the
solves would not be solving one network. So every draw here is a function of a *key* and
of where it is made, not of a generator's state:

- the key of layer n in training step k is `layer_key(seed, k, n)` (`LayerParallel` counts
  its training forward passes in `draw_step` and takes `seed` from `draw_seed`);
- inside one evaluation of a layer, the j-th draw (`Dropout` call, in call order) of an
  element at flat index i is a 32-bit hash of (key, j, i) (`uniform` maps it to [0, 1);
  dropout with probability p keeps the element where the hash is at least p * 2**32);
- a layer that draws from torch's generator in other ways (the attention dropout of
  nn.MultiheadAttention, noise layers) is evaluated with the generator seeded with the key
  (`seeded`), layer by layer.

The same layer therefore drops the same elements in every relaxation, level and in the
adjoint of a step, whatever batch it is evaluated in, and new ones the next step. Serial
training reproduces the draws with `draws(seed, k)` around its forward pass (see
`mgrit.nn.serial.ResidualStep`). The hash is integer arithmetic on tensors, so it runs
under `vmap` and in batched block kernels alike. On the CPU the masks of single keys are
hashed by mgrit's C library where it is available and allowed (`mgrit.kernels.choice`; bit
for bit the same masks, in 32-bit lanes instead of torch's int64 operations).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from ...kernels import choice, native

_MASK32 = 0xFFFFFFFF
# odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so the products
# are exact in int64 on every device (no reliance on wrapping overflow)
_M1, _M2, _M3 = 0x7FEB352D, 0x2C1B3C6D, 0x297A2D39


def _mix(h: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 tensors in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * _M1) & _MASK32
    h = h ^ (h >> 15)
    h = (h * _M2) & _MASK32
    h = h ^ (h >> 16)
    h = (h * _M3) & _MASK32
    return h ^ (h >> 15)


def _mix_int(h: int) -> int:
    """`_mix` on a Python int (for keys, computed once per layer and step)."""
    h &= _MASK32
    h ^= h >> 16
    h = (h * _M1) & _MASK32
    h ^= h >> 15
    h = (h * _M2) & _MASK32
    h ^= h >> 16
    h = (h * _M3) & _MASK32
    return h ^ (h >> 15)


def layer_key(seed: int, step: int, layer: int) -> int:
    """The key of `layer`'s draws in training step `step` of a network with `seed`: a
    32-bit value (an int), the same on every rank and in serial training."""
    h = _mix_int(seed & _MASK32)
    h = _mix_int(h ^ (seed >> 32) & _MASK32)
    h = _mix_int(h ^ (step & _MASK32))
    h = _mix_int(h ^ (step >> 32) & _MASK32)
    return _mix_int(h ^ (layer & _MASK32))


def layer_keys(seed: int, step: int, layers: Tensor) -> Tensor:
    """`layer_key` of every entry of an int64 tensor of layer indices (vectorised)."""
    h = _mix_int(seed & _MASK32)
    h = _mix_int(h ^ (seed >> 32) & _MASK32)
    h = _mix_int(h ^ (step & _MASK32))
    h = _mix_int(h ^ (step >> 32) & _MASK32)
    return _mix(layers.to(torch.int64) ^ h)


def _bits(key: Tensor, site: int, shape: torch.Size | tuple[int, ...],
          device: torch.device) -> Tensor:
    """32-bit hashes (int64) of every element index of `shape` under `key` and `site`;
    `key` may have leading dimensions (one row per key)."""
    numel = 1
    for n in shape:
        numel *= n
    index = torch.arange(numel, dtype=torch.int64, device=device).view(shape)
    k = _mix(key.to(device).reshape(*key.shape, *([1] * len(shape))) ^ _mix_int(_SALT ^ site))
    return _mix((index * _G + k) & _MASK32)


# a multiplier below 2**31 (index * _G stays exact for indices below 2**32) and a salt
_G, _SALT = 0x61C88647, 0x9E3779B9


def uniform(key: Tensor, site: int, shape: torch.Size | tuple[int, ...],
            device: torch.device) -> Tensor:
    """Floats in [0, 1) of `shape`, the `site`-th draw of an evaluation with `key`; `key`
    (int64, values below 2**32) may have leading dimensions (one key per layer of a batch):
    the result is then key.shape + shape, each row what that key alone gives."""
    return (_bits(key, site, shape, device) >> 8).to(torch.float32) * (1.0 / (1 << 24))


class _MaskCache:
    """Keep masks by (key, site, shape, device, threshold): a layer is evaluated several
    times in one training step with the same key, and hashing every element each time
    would cost as much as the layer's arithmetic. Oldest entries go first past `limit`
    bytes; keys change every step, so old entries are never asked for again."""

    def __init__(self, limit: int = 1 << 27) -> None:
        self.limit = limit
        self.entries: dict[tuple, Tensor] = {}
        self.bytes = 0

    def get(self, key: int, site: int, shape: tuple[int, ...], device: torch.device,
            threshold: int) -> Tensor:
        entry = (key, site, shape, device, threshold)
        mask = self.entries.get(entry)
        if mask is None:
            mask = _keep(key, site, shape, device, threshold)
            size = mask.numel()
            while self.entries and self.bytes + size > self.limit:
                old = self.entries.pop(next(iter(self.entries)))
                self.bytes -= old.numel()
            self.entries[entry] = mask
            self.bytes += size
        return mask

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0


def _keep(key: int, site: int, shape: tuple[int, ...], device: torch.device,
          threshold: int) -> Tensor:
    """The keep mask of one key: the C library's on the CPU where it may run (the same bits
    at a fraction of the cost), else `_bits` on tensors."""
    if (torch.device(device).type == "cpu" and choice.native_allowed(choice.native_backend())
            and native.available()):
        return native.keep_mask(_mix_int(key ^ _mix_int(_SALT ^ site)), shape, threshold)
    return _bits(torch.tensor(key, dtype=torch.int64), site, shape, device) >= threshold


_masks = _MaskCache()


def keep_mask(key: Tensor, site: int, shape: torch.Size | tuple[int, ...],
              device: torch.device, p: float) -> Tensor:
    """Which elements a dropout with probability p keeps (bool, key.shape + shape): those
    whose hash is at least p * 2**32, i.e. `uniform(key, site, i) >= p` up to the 2**-32
    resolution."""
    threshold = min(int(p * (1 << 32)), 1 << 32)
    if torch._C._functorch.is_batchedtensor(key):
        # under vmap (the general batched path): computed, not cached
        return _bits(key, site, shape, device) >= threshold
    shape = tuple(shape)
    rows = [_masks.get(k, site, shape, device, threshold) for k in key.reshape(-1).tolist()]
    if key.dim() == 0:
        return rows[0]
    return torch.stack(rows).view(*key.shape, *shape)


class _Keys(threading.local):
    def __init__(self) -> None:
        self.key: Tensor | None = None
        self.site = 0


_active = _Keys()


@contextlib.contextmanager
def keyed(key: Tensor | int | None) -> Iterator[None]:
    """Draws inside take `key` (an int, a 0-d tensor, or one key per layer of a batch for
    batched block kernels); sites count from 0. None: draws use torch's generator."""
    if key is not None and not isinstance(key, Tensor):
        key = torch.tensor(int(key) & _MASK32, dtype=torch.int64)
    saved = (_active.key, _active.site)
    _active.key, _active.site = key, 0
    try:
        yield
    finally:
        _active.key, _active.site = saved


def active() -> Tensor | None:
    """The key of the evaluation under way (see `keyed`), None outside one."""
    return _active.key


def next_site() -> int:
    site = _active.site
    _active.site = site + 1
    return site


class _Schedule(threading.local):
    def __init__(self) -> None:
        self.seed: int | None = None
        self.step = 0


_schedule = _Schedule()


@contextlib.contextmanager
def draws(seed: int, step: int) -> Iterator[None]:
    """Serial training with a layer-parallel network's draws: inside, layer n of a plain
    network (`mgrit.nn.serial.ResidualStep` with its `index`) draws with
    `layer_key(seed, step, n)`, as `LayerParallel` does in its training step `step`."""
    saved = (_schedule.seed, _schedule.step)
    _schedule.seed, _schedule.step = int(seed), int(step)
    try:
        yield
    finally:
        _schedule.seed, _schedule.step = saved


@contextlib.contextmanager
def seeded(key: int, device: torch.device) -> Iterator[None]:
    """torch's generators seeded with `key` inside (restored after): how layers that draw
    from them (not through `Dropout`) repeat their draws; `device`: the states' device."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(key)
        yield


def scheduled_key(layer: int) -> int | None:
    """The key of `layer` under `draws`, None outside it."""
    if _schedule.seed is None:
        return None
    return layer_key(_schedule.seed, _schedule.step, layer)


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Dropout whose mask is keyed (see the module's description) inside `keyed`, and
    torch's `dropout` outside. With a batch of keys, x's leading dimension is the batch."""
    if not training or p == 0.0:
        return x
    key = _active.key
    if key is None:
        return nn.functional.dropout(x, p, True)
    if p >= 1.0:
        return torch.zeros_like(x)
    keep = keep_mask(key, next_site(), x.shape[key.dim():], x.device, p)
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


class Dropout(nn.Module):
    """nn.Dropout with keyed draws: what `LayerParallel` puts in place of every nn.Dropout
    of its step modules (and `serial_resnet` of its layers), so that all evaluations of a
    layer in one training step drop the same elements."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = float(p)

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def replace_dropout(module: nn.Module) -> nn.Module:
    """Put `Dropout` in place of every nn.Dropout inside `module` (in place; returns it)."""
    for name, child in list(module.named_children()):
        if type(child) is nn.Dropout:
            swap = Dropout(child.p)
            swap.train(child.training)
            setattr(module, name, swap)
        else:
            replace_dropout(child)
    return module
