"""A rank's residual-network layers as stacked tensors.

Every layer is the same module type (made by the user's factory); its parameters are kept
as one tensor per parameter name with a leading layer dimension, so a batch of intervals
can be advanced by one call over strided views of those tensors, and the layers of one
rank are a handful of tensors for the optimiser.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ...kernels.chain import Chain
from . import randomness as draws
from .tied import Sharing

_NORM_WITH_STATS = (nn.modules.batchnorm._NormBase,)


def _sanitize(name: str) -> str:
    return name.replace(".", "__")


def build_layers(factory: Callable[[], nn.Module], num_steps: int, keep: range
                 ) -> tuple[nn.Module, dict[int, nn.Module], nn.Module | None]:
    """Call the factory once per layer, in layer order, keeping the layers in `keep`.

    Every rank draws the same random numbers in the same order as a serial
    `[factory() for _ in range(N)]`, so layer n starts from the same values whichever
    rank owns it. Returns a template (layer 0), the kept layers and, where the factory
    returned one module for every layer (weights tied across depth, `mgrit.nn.engine.tied`), that
    module; checks that all layers have the same parameters, shared by all layers or by
    none, and no running statistics. Every nn.Dropout inside
    becomes `mgrit.nn.Dropout` (keyed draws, see `mgrit.nn.draws`).
    """
    template = None
    kept: dict[int, nn.Module] = {}
    signature = None
    sharing = Sharing()
    for n in range(num_steps):
        layer = factory()
        if not isinstance(layer, nn.Module):
            raise TypeError(f"the step factory must return an nn.Module, got {type(layer).__name__}")
        sharing.check(layer, n)
        draws.replace_dropout(layer)
        for sub in layer.modules():
            if isinstance(sub, _NORM_WITH_STATS) and sub.track_running_stats:
                raise ValueError(
                    f"the step module contains {type(sub).__name__} with running statistics: "
                    "MGRIT evaluates every layer several times per forward pass, which would "
                    "update them more than once; use track_running_stats=False, or a norm "
                    "without state (LayerNorm, GroupNorm)")
        sig = tuple((name, tuple(p.shape), p.dtype, p.requires_grad)
                    for name, p in layer.named_parameters())
        if signature is None:
            signature = sig
        elif sig != signature:
            raise ValueError(f"layer {n} from the step factory differs from layer 0 in its "
                             f"parameters (name, shape, dtype, requires_grad): {sig} vs {signature}")
        if template is None:
            template = copy.deepcopy(layer)
        if n in keep:
            kept[n] = layer
    if template is None:
        raise ValueError("num_steps must be >= 1")
    return template, kept, sharing.tied


class LayerStack(nn.Module):
    """Layers first..last of a network (possibly none) with stacked parameters.

    `ghosts` holds copies of other ranks' layers that this rank's coarse steps use; they
    are refreshed by communication and never trained.
    """

    def __init__(self, template: nn.Module, layers: dict[int, nn.Module], first: int, last: int):
        super().__init__()
        self.first, self.last = first, last
        self.names = [name for name, _ in template.named_parameters()]
        self.buffer_names = [name for name, _ in template.named_buffers()]
        self._param_keys = [(name, _sanitize(name)) for name in self.names]
        self._buffer_keys = [(name, "buf__" + _sanitize(name)) for name in self.buffer_names]
        self.params = nn.ParameterDict()
        order = range(first, last + 1)
        for name in self.names:
            ref = dict(template.named_parameters())[name]
            rows = [dict(layers[n].named_parameters())[name].detach() for n in order]
            data = torch.stack(rows) if rows else ref.new_zeros((0, *ref.shape))
            self.params[_sanitize(name)] = nn.Parameter(data.clone(),
                                                        requires_grad=ref.requires_grad)
        for name in self.buffer_names:
            ref = dict(template.named_buffers())[name]
            rows = [dict(layers[n].named_buffers())[name] for n in order]
            data = torch.stack(rows) if rows else ref.new_zeros((0, *ref.shape))
            self.register_buffer("buf__" + _sanitize(name), data.clone())
        self.ghosts: dict[int, dict[str, Tensor]] = {}
        # where the ghost layers' tensors live (`storage_key`), made again when one comes
        self._ghost_key: tuple[int, ...] | None = None
        # The module structure that functional calls fill with a layer's tensors; kept out
        # of the registered submodules so its own weights are neither trained nor saved.
        template.requires_grad_(False)
        object.__setattr__(self, "template", template)
        self._modules_by_layer: dict[int, nn.Module] = {}
        self._views: dict[int, dict[str, Tensor]] = {}
        self._rows: dict[tuple[int, int, int], Any] = {}
        self._detached_tensors: dict[str, Tensor] | None = None
        self._detached_key: tuple[int, ...] = ()
        # the hand-written kernels' view of the step module, None where it is not a chain
        # of ops they cover (then torch.func computes)
        # where a parameter appears twice in the module (one Linear applied twice), the
        # kernels, which name each op's weights by the op's place, cannot see the tie
        tied_inside = (len(list(template.named_parameters(remove_duplicate=False)))
                       != len(self.names))
        self.chain = None if tied_inside else Chain.of(template)
        # a step module that advances a batch of layers itself (`forward_batched`, e.g.
        # `mgrit.nn.TransformerBlock`): no vmap, no per-sample fallbacks
        self.batched = callable(getattr(template, "forward_batched", None))
        # tensors constant over depth that every step takes as keyword arguments, set by
        # LayerParallel for the pass under way (masks, positions, conditioning)
        self.context: dict[str, Tensor] = {}
        # keyed draws: whether the step module has stochastic layers (keyed `Dropout`),
        # and whether it also draws from torch's generator (found by a probe under
        # vmap's randomness check; then batches run layer by layer, each layer seeded with
        # its key); `draw_seed` and `draw_step` give the keys (`mgrit.nn.draws`)
        # (a dropout of p = 0, as in a transformer block built without dropout, draws nothing)
        self.keyed_random = any(isinstance(m, draws.Dropout) and m.p > 0
                                for m in template.modules())
        self.torch_random = False
        self.draw_seed = 0
        self.draw_step = 0
        # the kernels the steps compute with (`mgrit.kernels.choice.KERNELS`; None: the
        # environment's default), set by LayerParallel and resolved at every solve
        self.kernels: str | None = None

    @property
    def random(self) -> bool:
        """Whether evaluations draw random numbers now (stochastic layers, training mode)."""
        return self.training and (self.keyed_random or self.torch_random)

    def drawing(self, layers: int | list[int] | Tensor):
        """The keys of `layers` (one layer: an int) for the evaluations inside, when the
        steps draw random numbers; a no-op context otherwise."""
        if not self.random:
            return contextlib.nullcontext()
        if isinstance(layers, int):
            return draws.keyed(draws.layer_key(self.draw_seed, self.draw_step, layers))
        # keys stay on the CPU: the masks they select are cached by value
        index = layers if isinstance(layers, Tensor) else torch.tensor(layers)
        return draws.keyed(draws.layer_keys(self.draw_seed, self.draw_step, index.cpu()))

    def train(self, mode: bool = True) -> "LayerStack":
        """Training or evaluation mode, for the template and the per-layer modules too
        (they are not registered submodules): dropout draws only in training."""
        super().train(mode)
        self.template.train(mode)
        for module in self._modules_by_layer.values():
            module.train(mode)
        return self

    @property
    def count(self) -> int:
        return self.last - self.first + 1 if self.last >= self.first else 0

    def tensors(self) -> dict[str, Tensor]:
        """Name -> stacked tensor (parameters and buffers), in the template's names."""
        params, buffers = self.params._parameters, self._buffers
        out = {name: params[key] for name, key in self._param_keys}
        for name, key in self._buffer_keys:
            out[name] = buffers[key]
        return out

    def layer_tensors(self, layer: int) -> dict[str, Tensor]:
        if self.first <= layer <= self.last:
            return {k: v[layer - self.first] for k, v in self.tensors().items()}
        if layer in self.ghosts:
            return self.ghosts[layer]
        raise KeyError(f"layer {layer} is neither owned ({self.first}..{self.last}) nor a "
                       "ghost on this rank")

    def rows(self, start: int, stride: int, count: int) -> dict[str, Tensor]:
        """Detached stacked tensors of layers start, start+stride, ... (cached views when
        all are owned and ascending, a gathered copy otherwise). Relaxation asks for the
        same few batches again and again; in-place updates by the optimizer show through
        the cached views, and `_apply` drops them."""
        end = start + stride * (count - 1)
        if self.first <= min(start, end) and max(start, end) <= self.last:
            key = (start, stride, count)
            tensors = self._detached()
            cached = self._rows.get(key)
            if stride > 0:
                if cached is None:
                    lo = start - self.first
                    cached = {k: v[lo: lo + stride * (count - 1) + 1: stride]
                              for k, v in tensors.items()}
                    self._rows[key] = cached
                return cached
            # descending: a gathered copy, kept until a tensor changes (its version moves)
            versions = tuple(v._version for v in tensors.values())
            if cached is None or cached[1] != versions:
                lo = start - self.first
                device = next(iter(tensors.values())).device
                index = torch.arange(lo, lo + stride * count, stride, device=device)
                cached = ({k: v.index_select(0, index) for k, v in tensors.items()}, versions)
                self._rows[key] = cached
            return cached[0]
        layers = [start + i * stride for i in range(count)]
        per_layer = [self.views(n) for n in layers]
        return {k: torch.stack([t[k] for t in per_layer]) for k in per_layer[0]}

    def forget_gathered(self) -> None:
        """Drop the gathered copies of descending rows. Their cache trusts the tensors'
        version counters, which a CUDA graph's replay does not move while the optimizer
        inside it updates the weights: a captured run must gather again when it is
        captured (not read a copy made before), and an eager pass after a replay (a
        controller's probe) must not read a copy of the weights before it."""
        self._rows = {key: rows for key, rows in self._rows.items()
                      if not isinstance(rows, tuple)}

    def _detached(self) -> dict[str, Tensor]:
        """The stacked tensors, detached; cached until a tensor gets new storage (`.data =`
        or a conversion), which also drops the cached views."""
        # what rows() checks on every call, so kept cheap: plain dict reads, no __getattr__
        key = tuple(map(Tensor.data_ptr, self._modules["params"]._parameters.values()))
        if self._buffer_keys:
            key += tuple(map(Tensor.data_ptr, self._buffers.values()))
        if self._detached_tensors is None or self._detached_key != key:
            tensors = self.tensors()
            self._rows.clear()
            self._views.clear()
            self._modules_by_layer.clear()
            self._detached_tensors = {k: v.detach() for k, v in tensors.items()}
            self._detached_key = key
        return self._detached_tensors

    def storage_key(self) -> tuple[int, ...]:
        """Where the stacked tensors and the ghost layers live: changes when any of them is
        given new storage (a CUDA graph of steps that read them is then stale)."""
        self._detached()
        if self._ghost_key is None:
            # a fetch of gathered levels' layers holds dozens: not read again at every solve
            self._ghost_key = tuple(t.data_ptr() for ghost in self.ghosts.values()
                                    for t in ghost.values())
        return self._detached_key + self._ghost_key

    def set_ghost(self, layer: int, values: dict[str, Tensor]) -> None:
        """Take a layer sent by its owner (name -> tensor, `flat_views` of the message),
        copied into its ghost tensors where it has them: they keep their storage, which
        the compiled phases read."""
        ghost = self.ghosts.get(layer)
        if ghost is None:
            self.ghosts[layer] = {k: v.clone() for k, v in values.items()}
            self._ghost_key = None
        else:
            for k, value in values.items():
                ghost[k].copy_(value)

    def install_ghost(self, layer: int, tensors: dict[str, Tensor]) -> None:
        """Make `tensors` layer `layer`'s ghost as they are (no copy: a reduction writes
        them in place, `mgrit.nn.engine.fetch`)."""
        self.ghosts[layer] = tensors
        self._ghost_key = None
        self._views.pop(layer, None)
        self._modules_by_layer.pop(layer, None)

    def _apply(self, fn, recurse=True):
        """Conversions (.to, .double, ...) give the tensors new storage: drop cached views
        and ghost layers (the next forward pass receives them again)."""
        self._modules_by_layer.clear()
        self._views.clear()
        self._rows.clear()
        self._detached_tensors = None
        self.ghosts.clear()
        self._ghost_key = None
        return super()._apply(fn, recurse)

    def views(self, layer: int) -> dict[str, Tensor]:
        """Layer `layer`'s tensors, detached views cached per layer (in-place updates by the
        optimizer show through; `_apply` and `set_ghost` keep them current)."""
        if layer not in self._views:
            self._views[layer] = {k: v.detach() for k, v in self.layer_tensors(layer).items()}
        return self._views[layer]

    def module(self, layer: int) -> nn.Module:
        """Layer `layer` as a plain module whose weights are (detached) views of the stacked
        tensors: a direct call, much cheaper than a functional call for single steps."""
        if layer not in self._modules_by_layer:
            mod = copy.deepcopy(self.template)
            for name, value in self.views(layer).items():
                path, _, attr = name.rpartition(".")
                sub = mod.get_submodule(path)
                sub._parameters.pop(attr, None)
                sub._buffers.pop(attr, None)
                setattr(sub, attr, value)
            mod.train(self.training)
            self._modules_by_layer[layer] = mod
        return self._modules_by_layer[layer]

    def placeholder(self) -> dict[str, Tensor]:
        """Zero tensors of one layer's shapes and dtypes (for checking what f returns)."""
        return {k: v.new_zeros(v.shape[1:]) for k, v in self.tensors().items()}

    def flat_size(self) -> int:
        """Elements of one layer's tensors, end to end (a ghost layer's message)."""
        return sum(int(torch.Size(v.shape[1:]).numel()) for v in self.tensors().values())

    def flat_layout(self) -> list[tuple[str, slice, torch.Size]]:
        """Where each of a layer's tensors lies in its flat form (`flat_views`), name by
        name: (name, its elements' slice, its shape)."""
        out, offset = [], 0
        for k, v in self.tensors().items():
            shape = v.shape[1:]
            size = int(torch.Size(shape).numel())
            out.append((k, slice(offset, offset + size), shape))
            offset += size
        return out

    def flat_views(self, flat: Tensor) -> dict[str, Tensor]:
        """One layer's tensors as views of `flat` (`flat_size` elements), name by name."""
        return {k: flat[where].view(shape) for k, where, shape in self.flat_layout()}

    # evaluation ----------------------------------------------------------------
    def f(self, tensors: dict[str, Tensor], u: Tensor) -> Tensor:
        return functional_call(self.template, tensors, (u,), self.context)
