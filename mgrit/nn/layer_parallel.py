"""Layer-parallel residual networks: `LayerParallel`, an nn.Module whose ODE part is solved by
MGRIT forward and backward (adjoint) inside ordinary PyTorch autograd."""

from __future__ import annotations

import copy
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ..comm import Comm, ReversedComm, as_comm
from ..core.config import Config
from ..core.cycle import Solver
from ..core.grid import (adjoint_blocks, build_hierarchy, coarse_layer_needs, layer_ranges,
                         level0_blocks)
from .defaults import training_config
from .propagators import AdjointPropagator, NetworkPropagator
from .serial import ResidualStep
from .stack import LayerStack, build_layers

CHECKPOINT_FORMAT = 1
# up to this many parameter values on a rank, the recorded gradients are gathered in one
# scatter per tensor; above, batch by batch (fewer passes over large data)
_GATHERED_GRADIENTS = 1 << 16


class _ODESolve(torch.autograd.Function):
    """u_N = MGRIT(u_0) forward; the adjoint MGRIT solve and parameter VJPs backward."""

    @staticmethod
    def forward(ctx, model: "LayerParallel", u0: Tensor, *params: Tensor) -> Tensor:
        out = model._solve_forward(u0, keep=True)
        ctx.model = model
        ctx.token = model._forward_token
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        model: LayerParallel = ctx.model
        if ctx.token != model._forward_token:
            raise RuntimeError("backward through an older forward pass: LayerParallel keeps "
                               "the states of its latest forward pass with gradients only")
        grad_u0, grads = model._solve_backward(grad_out)
        if model.data_comm is not None:
            torch.autograd.Variable._execution_engine.queue_callback(model._average_gradients)
        return (None, grad_u0, *grads)


class LayerParallel(nn.Module):
    """A residual network u_{n+1} = u_n + h f_n(u_n), n < num_steps, h = t_final/num_steps,
    between an `opening` and a `closing` module, with its layers spread over the ranks of
    `comm` and its forward and backward passes solved by MGRIT.

    step:      zero-argument factory of the residual function f (an nn.Module mapping a
               state to a state of the same shape); called num_steps times in layer order on
               every rank, each rank keeping its own layers.
    forward, backward: solver options of the two passes (default: 3 levels, coarsening 4,
               F-relaxation on the fine level and FCF below, 2 forward cycles, 1 backward
               cycle). `initial_guess="warm"` starts each solve from the previous step's.
    comm:      None (one process) or an mpi4py communicator of the layer-parallel group.
    data_comm: an mpi4py communicator joining replicas that hold the same layers
               (see `mgrit.split_world`); their gradients are averaged after each backward.
    opening, closing: modules before and after the ODE part, replicated on every rank.
    inference: solver options of forward passes in eval mode (`model.eval()`) without
               gradients; by default exact sequential stepping (levels=1): every rank
               marches its layers once the previous rank's state arrives, so evaluation
               gives the network's own output (what `to_serial()` computes), not the
               few-cycle approximation used in training, for the work of one serial forward
               pass. MGRIT solved to a tolerance would take many cycles for the same
               output (and never reach one below the dtype's round-off).

    `model(x)` returns the output on every rank. `model.stats` holds the cycles and
    residuals of the latest forward and backward solves.
    """

    def __init__(self, step: Callable[[], nn.Module], num_steps: int, t_final: float = 1.0,
                 forward: Config | None = None, backward: Config | None = None,
                 comm: Comm | Any = None, opening: nn.Module | None = None,
                 closing: nn.Module | None = None, data_comm: Any = None,
                 inference: Config | None = None) -> None:
        super().__init__()
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
        if not isinstance(t_final, (int, float)) or not t_final > 0:
            raise ValueError(f"t_final must be a positive number, got {t_final!r}")
        self.num_steps = num_steps
        self.t_final = float(t_final)
        self.h = self.t_final / num_steps
        self.forward_config = forward if forward is not None else training_config("forward")
        self.backward_config = (backward if backward is not None
                                else training_config("backward"))
        self.inference_config = (inference if inference is not None else
                                 replace(self.forward_config, levels=1, tol=0.0, max_iter=1,
                                         initial_guess="zero"))
        grids = {}
        for kind, cfg in (("forward", self.forward_config), ("backward", self.backward_config),
                          ("inference", self.inference_config)):
            if not isinstance(cfg, Config):
                raise TypeError(f"{kind} must be a mgrit.Config, got {type(cfg).__name__}")
            if isinstance(cfg.initial_guess, Tensor):
                raise ValueError(f"{kind}: a tensor initial guess makes no sense for training; "
                                 "use 'zero', 'nested' or 'warm'")
            grids[kind] = build_hierarchy(num_steps, cfg.coarsening_list(), cfg.levels,
                                          cfg.min_coarse)
            if len(grids[kind]) < cfg.levels:
                sizes = [g.num_steps for g in grids[kind]]
                raise ValueError(
                    f"num_steps={num_steps} is too small for the {kind} solver's levels="
                    f"{cfg.levels} with coarsening {cfg.coarsening} and min_coarse="
                    f"{cfg.min_coarse}: the levels would have {sizes} steps; use fewer levels, "
                    "a smaller coarsening or more layers")
        self.comm = as_comm(comm)
        self.data_comm = as_comm(data_comm) if data_comm is not None else None
        size, rank = self.comm.size, self.comm.rank
        self._blocks = level0_blocks(grids["forward"], size)
        self._adjoint_blocks = adjoint_blocks(self._blocks, num_steps)
        lo, hi = layer_ranges(self._blocks, num_steps)[rank]
        self.layer_range = (lo, hi)
        template, kept = build_layers(step, num_steps, range(lo, hi + 1))
        self.layers = LayerStack(template, kept, lo, hi)
        self.opening = opening if opening is not None else nn.Identity()
        self.closing = closing if closing is not None else nn.Identity()
        needs = coarse_layer_needs(grids["forward"], self._blocks)
        self._ghost_sends = [(tag, layer, r) for tag, (r, layer, owner) in enumerate(needs)
                             if owner == rank]
        self._ghost_recvs = [(tag, layer, owner) for tag, (r, layer, owner) in enumerate(needs)
                             if r == rank]
        self._forward_comm = self.comm.dup()
        self._backward_comm = ReversedComm(self.comm.dup())
        self._layer_comm = self.comm.dup()
        self._solvers: dict[tuple, Solver] = {}
        self._adjoint_solvers: dict[tuple, Solver] = {}
        self._checked_shapes: set[tuple] = set()
        self._forward_token = 0
        self._last_key: tuple | None = None
        self.stats: dict[str, dict[str, Any]] = {}

    # set-up ----------------------------------------------------------------------
    def _check_state(self, u0: Tensor) -> None:
        """Local checks (every rank reaches the same verdict), then one agreement."""
        key = (tuple(u0.shape), u0.dtype)
        if key not in self._checked_shapes:
            with torch.no_grad():
                out = self.layers.f(self.layers.placeholder(), u0.detach())
            if not isinstance(out, Tensor) or out.shape != u0.shape or out.dtype != u0.dtype:
                got = (f"shape {tuple(out.shape)}, dtype {out.dtype}" if isinstance(out, Tensor)
                       else type(out).__name__)
                raise ValueError(f"the step module maps a state of shape {tuple(u0.shape)}, "
                                 f"dtype {u0.dtype} to {got}; a residual step needs the same "
                                 "shape and dtype")
            self._checked_shapes.add(key)
        self.comm.agree("input batch shape and dtype", (tuple(u0.shape), str(u0.dtype)))

    def _solver(self, like: Tensor, keep: bool) -> Solver:
        """The forward solver for this input shape: `keep` for passes with gradients (its
        states serve the backward pass), otherwise one of its own, with the inference
        options in eval mode."""
        config = self.inference_config if (not keep and not self.training) else self.forward_config
        key = (tuple(like.shape), like.dtype, like.device, keep, config is self.inference_config)
        if key not in self._solvers:
            prop = NetworkPropagator(self.layers, like, keep)
            self._solvers[key] = Solver(prop, like, self.num_steps, 0.0, self.t_final, config,
                                        self._forward_comm, blocks=self._blocks,
                                        final_sweep=prop.final_sweep)
        return self._solvers[key]

    def _adjoint_solver(self, like: Tensor) -> Solver:
        key = (tuple(like.shape), like.dtype, like.device)
        if key not in self._adjoint_solvers:
            forward = self._solver(like, keep=True)
            states, offset = forward.fine_states()
            grids = build_hierarchy(self.num_steps, self.backward_config.coarsening_list(),
                                    self.backward_config.levels, self.backward_config.min_coarse)
            prop = AdjointPropagator(self.layers, self.num_steps, [g.stride for g in grids],
                                     states, offset, forward.prop.outputs)
            self._adjoint_solvers[key] = Solver(prop, like, self.num_steps, 0.0, self.t_final,
                                                self.backward_config, self._backward_comm,
                                                blocks=self._adjoint_blocks,
                                                final_sweep=prop.final_sweep)
        return self._adjoint_solvers[key]

    def _refresh_ghosts(self) -> None:
        """Copy the layers other ranks' coarse steps need to them (after every update)."""
        comm = self._layer_comm
        requests, received = [], []
        for tag, layer, owner in self._ghost_recvs:
            buf = torch.empty(self.layers.flat_size(), dtype=self._dtype(),
                              device=self._device())
            requests.append(comm.irecv(buf, owner, tag))
            received.append((layer, buf))
        for tag, layer, dest in self._ghost_sends:
            requests.append(comm.isend(self.layers.flatten_layer(layer).contiguous(), dest, tag))
        for req in requests:
            req.wait()
        for layer, buf in received:
            self.layers.set_ghost(layer, buf)

    def _dtype(self) -> torch.dtype:
        tensors = list(self.layers.tensors().values())
        return tensors[0].dtype if tensors else torch.get_default_dtype()

    def _device(self) -> torch.device:
        tensors = list(self.layers.tensors().values())
        return tensors[0].device if tensors else torch.device("cpu")

    # the two solves ----------------------------------------------------------------
    def _solve_forward(self, u0: Tensor, keep: bool) -> Tensor:
        with torch.no_grad():
            self._refresh_ghosts()
            solver = self._solver(u0, keep)
            solver.prop.begin()
            res = solver.solve(u0.detach())
        if keep:
            self._forward_token += 1
            self._last_key = (tuple(u0.shape), u0.dtype, u0.device)
        self.stats["forward"] = {"iterations": res.iterations, "residuals": res.residuals}
        return res.final

    def _solve_backward(self, grad_out: Tensor) -> tuple[Tensor, list[Tensor | None]]:
        with torch.no_grad():
            solver = self._adjoint_solver(grad_out)
            prop: AdjointPropagator = solver.prop
            prop.begin()
            res = solver.solve(grad_out.detach().contiguous())
            self.stats["backward"] = {"iterations": res.iterations, "residuals": res.residuals}
            grads = self._parameter_gradients(prop.gradients)
            if prop.outputs is not None:
                prop.outputs.clear()    # the forward pass's kept outputs are used up
        out = []
        for name in self.layers.names:
            param = self.layers.params[name.replace(".", "__")]
            out.append(grads[name] if param.requires_grad else None)
        return res.final, out

    def _parameter_gradients(self, recorded: list[tuple[list[int], dict[str, Tensor], float]]
                             ) -> dict[str, Tensor]:
        """dL/dtheta of the owned layers, as the adjoint's final fine sweep recorded them (its
        one VJP per layer, at final values, gives both w_n and dL/dtheta_n); where a layer
        was recorded twice, the later entry counts."""
        lo, hi = self.layer_range
        count = max(hi - lo + 1, 0)
        rows = [layer - lo for layers, _, _ in recorded for layer in layers]
        reached = set(rows)
        if not reached.issuperset(range(count)):
            missing = [lo + r for r in sorted(set(range(count)) - reached)]
            raise RuntimeError(f"the adjoint's final fine sweep did not reach layers {missing}")
        params = {name: self.layers.params[name.replace(".", "__")] for name in self.layers.names}
        dts = {dt for _, _, dt in recorded}
        values = count * sum(p[0].numel() for p in params.values()) if count else 0
        if len(rows) == count and len(dts) == 1 and values <= _GATHERED_GRADIENTS:
            # every layer once, one step size, little data (W2 on many ranks: a few batches
            # of a few layers): one scatter per tensor instead of a few calls per batch
            dt = dts.pop()
            index = torch.tensor(rows)
            grads = {}
            for name, param in params.items():
                parts = [cotangents[name] for _, cotangents, _ in recorded]
                grad = torch.empty_like(param)
                grad.index_copy_(0, index.to(param.device),
                                 torch.cat(parts) if len(parts) > 1 else parts[0])
                grads[name] = grad.mul_(dt)
            return grads
        grads = {name: torch.zeros_like(param) for name, param in params.items()}
        for layers, cotangents, dt in recorded:
            first, step = layers[0] - lo, (layers[1] - layers[0] if len(layers) > 1 else 1)
            if step != 0 and layers == list(range(layers[0], layers[-1] + step, step)):
                # an arithmetic progression (every batch is): slices, not index tensors
                at: slice | Tensor = slice(min(first, layers[-1] - lo),
                                           max(first, layers[-1] - lo) + 1, abs(step))
                flip = step < 0
            else:
                at, flip = torch.tensor(layers) - lo, False
            for name in grads:
                cot = cotangents[name]
                if isinstance(at, slice):
                    torch.mul(cot.flip(0) if flip else cot, dt, out=grads[name][at])
                else:
                    grads[name][at.to(cot.device)] = dt * cot
        return grads

    def forward(self, x: Tensor) -> Tensor:
        u0 = self.opening(x)
        if not isinstance(u0, Tensor):
            raise TypeError(f"the opening must return a tensor, got {type(u0).__name__}")
        self._check_state(u0)
        params = list(self.layers.params.values())
        if torch.is_grad_enabled() and (u0.requires_grad or any(p.requires_grad for p in params)):
            u_final = _ODESolve.apply(self, u0, *params)
        else:
            u_final = self._solve_forward(u0, keep=False)
        return self.closing(u_final)

    def _average_gradients(self) -> None:
        """Mean of the gradients over data-parallel replicas: one allreduce of one buffer."""
        params = [p for p in self.parameters() if p.requires_grad]
        if not params:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params])
        self.data_comm.allreduce_sum_(flat)
        flat /= self.data_comm.size
        offset = 0
        for p in params:
            n = p.numel()
            grad = flat[offset: offset + n].view_as(p)
            if p.grad is None:
                p.grad = grad.clone()
            else:
                p.grad.copy_(grad)
            offset += n

    # export and checkpoints -----------------------------------------------------------
    def to_serial(self) -> nn.Sequential | None:
        """The equivalent plain network (opening, ResidualStep layers, closing) on rank 0,
        None on the other ranks. Runs without MPI and gives the same outputs."""
        lo, hi = self.layer_range
        mine = {n: {k: v.detach().clone() for k, v in self.layers.layer_tensors(n).items()}
                for n in range(lo, hi + 1)}
        gathered = self.comm.gather_object(mine, 0)
        if self.comm.rank != 0:
            return None
        layers: dict[int, dict[str, Tensor]] = {}
        for part in gathered:
            layers.update(part)
        steps = []
        for n in range(self.num_steps):
            f = copy.deepcopy(self.layers.template)
            for name, value in layers[n].items():
                target = (f.get_parameter(name) if name in self.layers.names
                          else f.get_buffer(name))
                target.data = value.clone()
            for p, ref in zip(f.parameters(), self._requires_grad()):
                p.requires_grad_(ref)
            steps.append(ResidualStep(f, self.h))
        return nn.Sequential(copy.deepcopy(self.opening), *steps, copy.deepcopy(self.closing))

    def _requires_grad(self) -> list[bool]:
        return [self.layers.params[n.replace(".", "__")].requires_grad for n in self.layers.names]

    def _layout(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, "t_final": self.t_final, "ranks": self.comm.size,
                "rank": self.comm.rank, "layers": self.layer_range,
                "parameters": [(n, tuple(p.shape[1:])) for n, p in
                               zip(self.layers.names, self.layers.params.values())]}

    def checkpoint_path(self, directory: str | os.PathLike) -> Path:
        data = (f"-data{self.data_comm.rank:05d}" if self.data_comm is not None else "")
        return Path(directory) / f"rank{self.comm.rank:05d}-of-{self.comm.size:05d}{data}.pt"

    def save_checkpoint(self, directory: str | os.PathLike,
                        optimizer: torch.optim.Optimizer | None = None, **extra: Any) -> Path:
        """Write this rank's layers, opening, closing, optimizer state and warm-start states
        to `directory` (one file per rank, written then renamed: never half a file)."""
        path = self.checkpoint_path(directory)
        path.parent.mkdir(parents=True, exist_ok=True)
        warm = {}
        for kind, solvers in (("forward", self._solvers), ("backward", self._adjoint_solvers)):
            cfg = self.forward_config if kind == "forward" else self.backward_config
            if cfg.initial_guess == "warm":
                warm[kind] = {key[:2]: s.warm_states() for key, s in solvers.items()
                              if s.has_solved and (kind == "backward" or key[3])}
        state = {"format": CHECKPOINT_FORMAT, "layout": self._layout(),
                 "model": self.state_dict(),
                 "optimizer": optimizer.state_dict() if optimizer is not None else None,
                 "warm": warm, "extra": extra}
        tmp = path.with_name(path.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        return path

    def load_checkpoint(self, directory: str | os.PathLike,
                        optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Restore what `save_checkpoint` wrote; returns its extra entries. A checkpoint of a
        different network or partition is refused with the difference named."""
        path = self.checkpoint_path(directory)
        if not path.exists():
            raise FileNotFoundError(f"no checkpoint for this rank at {path}")
        state = torch.load(path, map_location=self._device(), weights_only=False)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path} is not a mgrit checkpoint of format {CHECKPOINT_FORMAT}")
        mine = self._layout()
        for key, value in state["layout"].items():
            if mine.get(key) != value:
                raise ValueError(f"{path} holds a different network or partition: {key} is "
                                 f"{value!r} there and {mine.get(key)!r} here")
        self.load_state_dict(state["model"])
        if optimizer is not None:
            if state["optimizer"] is None:
                raise ValueError(f"{path} has no optimizer state")
            optimizer.load_state_dict(state["optimizer"])
        for kind, entries in state["warm"].items():
            for (shape, dtype), rows in entries.items():
                like = torch.zeros(shape, dtype=dtype, device=self._device())
                solver = (self._solver(like, keep=True) if kind == "forward"
                          else self._adjoint_solver(like))
                solver.set_warm_states(rows)
        return state["extra"]

    def extra_repr(self) -> str:
        lo, hi = self.layer_range
        return (f"num_steps={self.num_steps}, t_final={self.t_final}, rank {self.comm.rank} of "
                f"{self.comm.size} owns layers {lo}..{hi}")

