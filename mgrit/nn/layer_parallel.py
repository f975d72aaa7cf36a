"""Layer-parallel residual networks: `LayerParallel`, an nn.Module whose ODE part is solved by
MGRIT forward and backward (adjoint) inside ordinary PyTorch autograd.

It composes the parts of that job: the two solves (`passes`), the copies of other ranks'
layers that coarse steps use (`ghosts`), the parameter gradients (`gradients`), and
checkpoints (`checkpoint`) and export (`export`); `checks` holds what it checks before
it solves."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ..comm import Comm, as_comm
from ..comm.cuts import CutComm, Cuts
from ..core.config import Config
from ..core.grid import level0_blocks
from ..kernels.choice import check_kernels
from . import checkpoint, clipping, export
from .checks import check_backward_thread, check_inputs, level_grids, partition
from .defaults import training_config
from .engine.ghosts import GhostExchange
from .engine.gradients import average_gradients, context_gradients, layer_gradients
from .engine.passes import Passes
from .engine.precision import autocast_state, reentered
from .engine.stack import LayerStack, build_layers
from .engine.module_strategy import CONTEXT
from .engine.tied import TiedWeights


class _ODESolve(torch.autograd.Function):
    """u_N = MGRIT(u_0) forward; the adjoint MGRIT solve, parameter and context VJPs
    backward."""

    @staticmethod
    def forward(ctx, model: "LayerParallel", names: tuple[str, ...], u0: Tensor,
                *tensors: Tensor) -> Tensor:
        out = model._solve_forward(u0, keep=True)
        ctx.model = model
        ctx.token = model._forward_token
        ctx.taped = model._passes.tape.holds_graph
        ctx.context = dict(zip(names, tensors))
        ctx.draw_step = model.layers.draw_step
        # autograd runs the backward outside the user's autocast block: the adjoint
        # re-enters the forward pass's state, so that its VJPs linearise the same ops
        ctx.autocast = autocast_state(u0.device.type)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        model: LayerParallel = ctx.model
        if ctx.token != model._forward_token:
            raise RuntimeError("backward through an older forward pass: LayerParallel keeps "
                               "the states of its latest forward pass with gradients only")
        # the forward pass's context and random draws, whatever passes came in between
        model.layers.context = ctx.context
        model.layers.draw_step = ctx.draw_step
        # dL/du0 only where the opening or the input needs it (the same on every rank,
        # as the graph before the solve is): else its broadcast, a collective, is skipped
        with reentered(ctx.autocast):
            grad_u0, context_grads, grads = model._solve_backward(
                grad_out, ctx.needs_input_grad[2], ctx.taped)
        if model.data_comm is not None:
            torch.autograd.Variable._execution_engine.queue_callback(model._average_gradients)
        return (None, None, grad_u0, *[context_grads.get(name) for name in ctx.context],
                *grads)


class LayerParallel(nn.Module):
    """A residual network u_{n+1} = u_n + h f_n(u_n), n < num_steps, h = t_final/num_steps,
    between an `opening` and a `closing` module, with its layers spread over the ranks of
    `comm` and its forward and backward passes solved by MGRIT.

    step:      zero-argument factory of the residual function f (an nn.Module mapping a
               state to a state of the same shape); called num_steps times in layer order on
               every rank, each rank keeping its own layers; one module returned every
               time ties the layers' weights (trained as one, `mgrit.nn.engine.tied`).
    forward, backward: solver options of the two passes (default: 3 levels, coarsening 4,
               F-relaxation on the fine level and FCF below, 2 forward cycles, 1 backward
               cycle). `initial_guess="warm"` starts each solve from the previous step's.
               Where both are exact (levels=1) and the steps compute with torch's ops
               (no mgrit kernels for them), passes with gradients run on torch's own graph
               (`mgrit.nn.engine.tape`): serial PyTorch's work and memory, one backward
               pass per forward pass.
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

    seed:      the seed of the keyed random draws of stochastic layers (dropout; see
               `mgrit.nn.draws`); default: rank 0's `torch.initial_seed()`.

    kernels:   what the steps compute with, one of `mgrit.kernels.choice.KERNELS`: "auto"
               (mgrit's native CPU kernels where they pay, relaxation phases of narrow
               dense tanh steps compiled into one call each), "kernels" (the same kernels
               step by step), "torch" (torch's kernels only, such phases as planned loops of
               torch's calls) or "torch-steps" (torch's kernels step by step); default: the
               environment variable MGRIT_NATIVE, else "auto".

    `model(x, **context)` returns the output on every rank; the context tensors (masks,
    positions, conditioning: constant over depth) go to every step as keyword arguments,
    on every level and in the adjoint, and get gradients where they require grad.
    `model.stats` holds the cycles and residuals of the latest forward and backward solves.
    `set_solvers` changes the solver options between steps, `probing` runs passes with
    other options beside training's (`mgrit.nn.Controller` uses both).
    In training mode every forward pass is a new training step of the draws: layer n of
    pass k draws with `mgrit.nn.layer_key(seed, k, n)` (`draw_step` counts the passes;
    data-parallel replicas draw apart, see `set_draw_seed`).
    """

    def __init__(self, step: Callable[[], nn.Module], num_steps: int, t_final: float = 1.0,
                 forward: Config | None = None, backward: Config | None = None,
                 comm: Comm | Any = None, opening: nn.Module | None = None,
                 closing: nn.Module | None = None, data_comm: Any = None,
                 inference: Config | None = None, seed: int | None = None,
                 kernels: str | None = None) -> None:
        super().__init__()
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
        if not isinstance(t_final, (int, float)) or not t_final > 0:
            raise ValueError(f"t_final must be a positive number, got {t_final!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        check_kernels(kernels)
        self.num_steps = num_steps
        self.t_final = float(t_final)
        self.h = self.t_final / num_steps
        self.forward_config = forward if forward is not None else training_config("forward")
        self.backward_config = (backward if backward is not None
                                else training_config("backward"))
        self.inference_config = (inference if inference is not None else
                                 replace(self.forward_config, levels=1, tol=0.0, max_iter=1,
                                         initial_guess="zero"))
        grids = {kind: level_grids(kind, cfg, num_steps) for kind, cfg in
                 (("forward", self.forward_config), ("backward", self.backward_config),
                  ("inference", self.inference_config))}
        self.comm = as_comm(comm)
        self.data_comm = as_comm(data_comm) if data_comm is not None else None
        # a captured run on several ranks is cut at the calls of the model's communicators
        # (every one is a duplicate of these two): `mgrit.comm.cuts`, `mgrit.nn.capture`
        self._cuts: Cuts | None = None
        if self.comm.size > 1 or (self.data_comm is not None and self.data_comm.size > 1):
            self._cuts = Cuts()
            if self.comm.size > 1:
                self.comm = CutComm(self.comm, self._cuts)
            if self.data_comm is not None and self.data_comm.size > 1:
                self.data_comm = CutComm(self.data_comm, self._cuts)
        blocks = level0_blocks(grids["forward"], self.comm.size)
        lo, hi = partition(blocks, num_steps)[self.comm.rank]
        self.layer_range = (lo, hi)
        template, kept, tied = build_layers(step, num_steps, range(lo, hi + 1))
        self.layers = LayerStack(template, kept, lo, hi)
        self.layers.kernels = kernels
        # weights tied across depth: the one module is what trains (`mgrit.nn.engine.tied`)
        self.tied_step = tied
        self._tied = TiedWeights(tied, self.layers, self.comm) if tied is not None else None
        self.set_draw_seed(self._agreed_seed(seed))
        self.draw_step = 0      # training forward passes so far: the next one's draws
        self.opening = opening if opening is not None else nn.Identity()
        self.closing = closing if closing is not None else nn.Identity()
        self._passes = Passes(self.layers, num_steps, self.t_final, self.forward_config,
                              self.backward_config, self.inference_config, self.comm, blocks,
                              [g.stride for g in grids["backward"]])
        self._ghosts = GhostExchange(self.layers, grids["forward"], blocks, self.comm)
        self._blocks = blocks
        self._checked_shapes: set[tuple] = set()
        # counts forward passes with gradients: a backward pass must follow the latest one
        self._forward_token = 0
        # while probing: the training step whose random draws every forward pass repeats
        self._held_draw_step: int | None = None
        # the options, solvers and ghost exchange of probes (one set, reconfigured when a
        # probe asks for other options)
        self._probe: tuple[tuple, Passes, GhostExchange] | None = None
        self._timed = False     # inside `probing`: solves are timed to the device's end
        self.stats: dict[str, dict[str, Any]] = {}

    # set-up ----------------------------------------------------------------------
    def _agreed_seed(self, seed: int | None) -> int:
        """The draws' seed: given, or rank 0's `torch.initial_seed()` (63 bits)."""
        if seed is not None:
            return seed
        value = torch.tensor([torch.initial_seed() & ((1 << 63) - 1)], dtype=torch.int64)
        self.comm.bcast_(value, 0)
        return int(value[0])

    def set_draw_seed(self, seed: int) -> None:
        """The seed of the keyed draws. Data-parallel replica r > 0 draws with
        seed + r * 2**48: the replicas' samples are different samples, and must not share
        masks (replica 0, and a model without replicas, draws with `seed` itself)."""
        self.draw_seed = seed
        replica = self.data_comm.rank if self.data_comm is not None else 0
        self.layers.draw_seed = seed + replica * (1 << 48)

    # solver options between steps ------------------------------------------------------
    def set_solvers(self, forward: Config | None = None, backward: Config | None = None
                    ) -> None:
        """Solve the next training passes with these options (None: that pass keeps its
        own): more or fewer cycles, levels or another relaxation between two training
        steps, as `mgrit.nn.Controller` does. Collective: every rank calls it with the same
        options. The layers stay where they are (their partition was fixed when the model
        was built); the solvers are built again at first use and start warm from the states
        the old ones left, so `initial_guess="warm"` carries on across the change. A
        backward pass through a forward pass taken before the change is refused."""
        forward = self.forward_config if forward is None else forward
        backward = self.backward_config if backward is None else backward
        grids = {kind: level_grids(kind, cfg, self.num_steps)
                 for kind, cfg in (("forward", forward), ("backward", backward))}
        self.comm.agree("solver options of set_solvers",
                        tuple(tuple(sorted(cfg.describe().items()))
                              for cfg in (forward, backward)))
        self.forward_config, self.backward_config = forward, backward
        self._passes.set_configs(forward, backward, [g.stride for g in grids["backward"]])
        self._ghosts.set_grids(grids["forward"])
        self._forward_token += 1

    @contextlib.contextmanager
    def probing(self, forward: Config, backward: Config
                ) -> Iterator[dict[str, dict[str, Any]]]:
        """Passes inside run with these solver options, on solvers of their own (built at
        the first probe, reused by the next with the same options): a second, more accurate
        look at the training step just taken, as `mgrit.nn.Controller` does. Training's
        solvers and their warm-start states, `stats` and `draw_step` are as they were
        afterwards, and forward passes in training mode inside draw the random numbers of
        the latest training pass, so that the probe evaluates the network that pass
        evaluated. It yields the `stats` of the passes inside. Collective: every rank probes
        with the same options. Call it after a training step's backward pass (its gradients
        are the probe's to compare with)."""
        key = tuple(tuple(sorted(cfg.describe().items())) for cfg in (forward, backward))
        if self._probe is None or self._probe[0] != key:
            grids = {kind: level_grids(kind, cfg, self.num_steps)
                     for kind, cfg in (("forward", forward), ("backward", backward))}
            self.comm.agree("solver options of a probe", key)
            strides = [g.stride for g in grids["backward"]]
            if self._probe is None:
                passes = Passes(self.layers, self.num_steps, self.t_final, forward, backward,
                                self.inference_config, self.comm, self._blocks, strides)
                ghosts = GhostExchange(self.layers, grids["forward"], self._blocks, self.comm)
            else:
                # the same communicators, new solvers: a probe starts from its own guess,
                # never from another probe's states
                _, passes, ghosts = self._probe
                passes.set_configs(forward, backward, strides, carry=False)
                ghosts.set_grids(grids["forward"])
            self._probe = (key, passes, ghosts)
        saved = (self._passes, self._ghosts, self.draw_step, self.stats,
                 self._held_draw_step, self._timed)
        self._passes, self._ghosts = self._probe[1:]
        self._held_draw_step = max(self.draw_step - 1, 0)
        self.stats = {}
        self._timed = True
        try:
            yield self.stats
        finally:
            (self._passes, self._ghosts, self.draw_step, self.stats,
             self._held_draw_step, self._timed) = saved

    # the two solves ----------------------------------------------------------------
    def _clock(self, t: Tensor) -> float:
        """Seconds on the host clock; inside `probing` on a GPU, after the device has done
        the work queued so far. A solve's launches return before its kernels end, so the
        host's time alone is what launching took: the controller's cost model, fed by the
        probes, wants the solve's whole time. A training step never waits here, so the host
        can stay ahead of the device (its `stats` "seconds" are the host's time)."""
        if self._timed and t.is_cuda:
            torch.cuda.synchronize(t.device)
        return time.perf_counter()

    def _trained(self) -> list[nn.Parameter]:
        """What the optimizer trains of the layers, in the stack's parameter names: the
        stacked rows, or the one module of tied weights."""
        return (self._tied.parameters() if self._tied is not None
                else list(self.layers.params.values()))

    def _solve_forward(self, u0: Tensor, keep: bool) -> Tensor:
        if self.training:
            if self._held_draw_step is not None:
                self.layers.draw_step = self._held_draw_step
            else:
                self.layers.draw_step = self.draw_step
                self.draw_step += 1
        with torch.no_grad():
            self._ghosts.refresh()
        if keep and self._passes.taped(u0):
            # exact passes on torch's graph (`mgrit.nn.engine.tape`): one sweep, whose
            # residual is zero by construction
            start = self._clock(u0)
            final = self._passes.tape_forward(u0, [p.requires_grad for p in self._trained()])
            seconds = self._clock(u0) - start
            iterations, residuals = 1, [0.0]
        else:
            with torch.no_grad():
                # a solver is built at its first use: the solve's time leaves that out
                self._passes.forward_solver(u0, keep, inference=not self.training)
                start = self._clock(u0)
                res = self._passes.solve_forward(u0, keep, inference=not self.training)
                seconds = self._clock(u0) - start
            if keep:
                self._passes.mark_solved()
            final, iterations, residuals = res.final, res.iterations, res.residuals
        if keep:
            self._forward_token += 1
        # the norm of the given state: what the residuals are relative to
        self.stats["forward"] = {"iterations": iterations, "residuals": residuals,
                                 "initial_norm": self._passes.initial_norm(u0, keep),
                                 "seconds": seconds}
        return final

    def _solve_backward(self, grad_out: Tensor, grad_u0: bool = True, taped: bool = False
                        ) -> tuple[Tensor | None, dict[str, Tensor], list[Tensor | None]]:
        """The backward pass of the latest forward pass with gradients: through its graph
        where it was `taped`, else the adjoint solve."""
        with torch.no_grad():
            if taped:
                start = self._clock(grad_out)
                u0_grad, context_grads, grads = self._passes.tape.backward(grad_out, grad_u0)
                seconds = self._clock(grad_out) - start
                iterations, residuals = 1, [0.0]
            else:
                self._passes.adjoint_solver(grad_out)
                start = self._clock(grad_out)
                res, recorded = self._passes.solve_backward(grad_out, grad_u0)
                seconds = self._clock(grad_out) - start
                u0_grad, iterations, residuals = res.final, res.iterations, res.residuals
                grads = layer_gradients(self.layers, recorded)
                context_grads = context_gradients(recorded, self.layers.context, CONTEXT)
            self.stats["backward"] = {"iterations": iterations, "residuals": residuals,
                                      "initial_norm": self._passes.initial_norm(grad_out),
                                      "seconds": seconds}
            if context_grads and self.comm.size > 1:
                # each rank's sum covers its own layers: the whole is the sum over ranks
                flat = torch.cat([g.reshape(-1) for g in context_grads.values()])
                self.comm.allreduce_sum_(flat)
                offset = 0
                for name, g in context_grads.items():
                    g.copy_(flat[offset: offset + g.numel()].view_as(g))
                    offset += g.numel()
        if self._tied is not None:
            return u0_grad, context_grads, self._tied.gradients(grads)
        out = []
        for name in self.layers.names:
            param = self.layers.params[name.replace(".", "__")]
            out.append(grads[name] if param.requires_grad else None)
        return u0_grad, context_grads, out

    def forward(self, x: Tensor, **context: Tensor) -> Tensor:
        u0 = self.opening(x)
        if not isinstance(u0, Tensor):
            raise TypeError(f"the opening must return a tensor, got {type(u0).__name__}")
        self.layers.context = context
        check_inputs(self, u0, context)
        self._fill_tied_rows()
        params = self._trained()
        names = tuple(context)
        values = tuple(context.values())
        if torch.is_grad_enabled() and (u0.requires_grad or any(p.requires_grad for p in params)
                                        or any(v.requires_grad for v in values)):
            check_backward_thread(self, u0.device)
            u_final = _ODESolve.apply(self, names, u0, *values, *params)
        else:
            u_final = self._solve_forward(u0, keep=False)
        return self.closing(u_final)

    def _fill_tied_rows(self) -> None:
        """Tied weights: the rows := the module the optimizer updates (`mgrit.nn.engine.tied`)."""
        if self._tied is not None:
            self._tied.fill_rows()

    def _average_gradients(self) -> None:
        """Mean of the gradients over data-parallel replicas (after each backward pass)."""
        average_gradients(self.parameters(), self.data_comm)

    # gradient clipping ---------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float | str = 2.0,
                        error_if_nonfinite: bool = False) -> Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the whole network: the norm of every
        layer's gradient on every rank and of the opening's and closing's (counted once),
        after data-parallel averaging; every rank scales by the same factor and gets the
        same norm back. Collective: every rank of the model calls it."""
        mine = set(map(id, self.layers.parameters()))
        return clipping.clip_grad_norm_(list(self.layers.parameters()),
                                        [p for p in self.parameters() if id(p) not in mine],
                                        self.comm, max_norm, norm_type, error_if_nonfinite)

    def clip_grad_value_(self, clip_value: float) -> None:
        """torch's `clip_grad_value_` on this rank: element-wise, so no collective needed."""
        torch.nn.utils.clip_grad_value_(self.parameters(), clip_value)

    # export and checkpoints -----------------------------------------------------------
    def to_serial(self) -> nn.Sequential | None:
        """The equivalent plain network (opening, ResidualStep layers, closing) on rank 0,
        None on the other ranks. Runs without MPI and gives the same outputs."""
        self._fill_tied_rows()
        return export.to_serial(self)

    def checkpoint_path(self, directory: str | os.PathLike) -> Path:
        return checkpoint.checkpoint_path(self, directory)

    def save_checkpoint(self, directory: str | os.PathLike,
                        optimizer: torch.optim.Optimizer | None = None, **extra: Any) -> Path:
        """Write this rank's layers, opening, closing, optimizer state and warm-start states
        to `directory` (one file per rank, written then renamed: never half a file). Any
        number of layer-parallel ranks can load it (`load_checkpoint`), and
        `mgrit.nn.serial_state_dict(directory)` reads it as a plain serial network's."""
        self._fill_tied_rows()
        return checkpoint.save(self, self._passes, directory, optimizer, extra)

    def load_checkpoint(self, directory: str | os.PathLike,
                        optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Restore what `save_checkpoint` wrote, on this or any other number of
        layer-parallel ranks; returns its extra entries. Every rank of the model calls it (a
        failure on one raises on all).

        Each rank takes its layers, and their optimizer state (SGD's momentum, Adam's
        moments), row by row from the files that hold them; the opening, closing and
        per-group settings are the same in every file. Warm-start states belong to one
        partition of the layers: they are restored when the partition is the same as when
        saved and dropped otherwise (the next passes start cold, as the first ones did).
        The number of data-parallel replicas must be the same. A missing, incomplete or
        unreadable checkpoint, or one of a different network, raises
        `mgrit.nn.CheckpointError` naming the file and the difference."""
        return checkpoint.load(self, self._passes, directory, optimizer)

    def extra_repr(self) -> str:
        lo, hi = self.layer_range
        return (f"num_steps={self.num_steps}, t_final={self.t_final}, rank {self.comm.rank} of "
                f"{self.comm.size} owns layers {lo}..{hi}")
