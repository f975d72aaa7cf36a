"""The two MGRIT solves of a layer-parallel network: a forward and an adjoint `Solver` for
each input shape, dtype and device (built at first use, reused by every later pass), and
running them. Solvers keep their level storage and warm-start states between passes, which
is why they are cached rather than built per pass."""

from __future__ import annotations

import torch
from torch import Tensor

from ...comm import Comm, ReversedComm
from ...core.config import Config
from ...core.cycle import Result, Solver
from ...core.grid import adjoint_blocks
from .adjoint import AdjointPropagator
from .module_strategy import StepSelection
from .propagators import NetworkPropagator
from .stack import LayerStack
from .tape import Tape


class Passes:
    """Forward and adjoint solvers over the layers of one rank.

    blocks:           the ranks' level-0 blocks of the forward grid (the adjoint's follow
                      from them).
    backward_strides: the strides of the adjoint's levels (its grids' `stride`).
    comm:             the layer-parallel group; each pass gets a duplicate of its own, so
                      its messages never match the other pass's or the ghost exchange's.
    """

    def __init__(self, layers: LayerStack, num_steps: int, t_final: float,
                 forward: Config, backward: Config, inference: Config, comm: Comm,
                 blocks: list[tuple[int, int]], backward_strides: list[int]) -> None:
        self.layers = layers
        self.num_steps = num_steps
        self.t_final = t_final
        self.forward_config = forward
        self.backward_config = backward
        self.inference_config = inference
        self.blocks = blocks
        self.adjoint_blocks = adjoint_blocks(blocks, num_steps)
        self.backward_strides = backward_strides
        self.forward_comm = comm.dup()
        self.backward_comm = ReversedComm(comm.dup())
        # (shape, dtype, device, keep, inference options) -> forward solver
        self.forward_solvers: dict[tuple, Solver] = {}
        # (shape, dtype, device) -> adjoint solver
        self.adjoint_solvers: dict[tuple, Solver] = {}
        # ("forward" or "backward", shape, dtype, device) -> the level-0 rows a solver of the
        # options before `set_configs` left, for the solver that replaces it
        self._carried: dict[tuple, Tensor] = {}
        # whether training's solves are captured ones (`set_captured`), and forward passes
        # without gradients (`set_captured_no_grad`)
        self.captured = False
        self.captured_no_grad = False
        # counts the times solvers were dropped (`set_configs`): a CUDA graph of a solve
        # made before reads memory that may since have been given to other tensors
        self.generation = 0
        # exact passes with gradients on torch's graph (`taped`), with a communicator of
        # their own; the key (shape, dtype, device) of the latest one, None when the
        # latest pass with gradients was a solve
        self.tape = Tape(layers, comm.dup(), num_steps, t_final)
        self._taped_key: tuple | None = None
        self._selections: dict[tuple, StepSelection] = {}

    def set_captured(self, captured: bool) -> None:
        """Solve the passes with gradients as captured solves (`Solver.captured`: no host
        reads, residual norms on the device) or not; their solvers are built again, warm
        from the states the old ones left."""
        if captured != self.captured:
            self.captured = captured
            self.set_configs(self.forward_config, self.backward_config, self.backward_strides)

    def set_captured_no_grad(self, captured: bool) -> None:
        """Solve forward passes without gradients (training mode's and inference's) as
        captured solves or not. Only the solve's ending differs (`Solver.captured`), so
        their solvers stay, with their states: a warm-started pass carries on."""
        self.captured_no_grad = captured
        for key, solver in self.forward_solvers.items():
            if not key[3]:
                solver.captured = captured

    def _captured(self, keep: bool) -> bool:
        """Whether a forward pass with (`keep`) or without gradients is a captured solve."""
        return self.captured if keep else self.captured_no_grad

    def set_configs(self, forward: Config, backward: Config, backward_strides: list[int],
                    carry: bool = True) -> None:
        """Solve the next passes with these options. Their solvers are built again at first
        use; with `carry` each starts warm from the states its predecessor for the same
        input left, which fit whatever the hierarchy, since level-0 rows follow from the
        blocks alone. Solvers of the inference options stay as they are."""
        if not carry:
            self._carried = {}
        for kind, solvers in (("forward", self.forward_solvers),
                              ("backward", self.adjoint_solvers)):
            for key, solver in solvers.items():
                if carry and (kind == "backward" or key[3]):
                    rows = solver.warm_states()
                    if rows is not None:
                        self._carried[(kind, *key[:3])] = rows
        if carry and self._taped_key is not None:
            # the latest passes were taped: their states are the freshest to start from
            self._carried.update(self._taped_rows(self._taped_key))
        self.tape.drop()
        self.forward_config = forward
        self.backward_config = backward
        self.backward_strides = backward_strides
        self.forward_solvers = {key: s for key, s in self.forward_solvers.items() if key[4]}
        self.adjoint_solvers = {}
        self.generation += 1

    def taped(self, like: Tensor) -> bool:
        """Whether the next passes with gradients for states like `like` run on torch's
        graph (`mgrit.nn.engine.tape`): both exact (one level), not captured, and the
        steps computing with torch's ops (a strategy that keeps no op outputs)."""
        if (self.captured or self.forward_config.levels != 1
                or self.backward_config.levels != 1):
            return False
        key = (tuple(like.shape), like.dtype, like.device)
        selection = self._selections.get(key)
        if selection is None:
            selection = self._selections[key] = StepSelection(self.layers, like)
        return not selection.current().keeps_values

    def tape_forward(self, u0: Tensor, wanted: list[bool]) -> Tensor:
        """`Tape.forward`, remembered as the latest pass with gradients."""
        out = self.tape.forward(u0, wanted)
        self._taped_key = (tuple(u0.shape), u0.dtype, u0.device)
        return out

    def mark_solved(self) -> None:
        """The latest pass with gradients was a solve, not a taped pass."""
        self._taped_key = None
        self.tape.drop()

    def _taped_rows(self, key: tuple) -> dict[tuple, Tensor]:
        """The level-0 rows of this rank's forward and adjoint solvers (`Solver.fine_states`:
        the previous rank's last point, then the rank's own) as the latest taped passes
        left them, for solvers of states like `key` that start warm from them; a pass
        whose points do not cover the rows (none yet) is left out."""
        rank, size = self.tape.comm.rank, self.tape.comm.size
        n = self.num_steps
        first, last = self.blocks[rank]
        a_first, a_last = self.adjoint_blocks[size - 1 - rank]
        # the first rank's row 0 stands before the first point: the solvers hold zeros
        wanted = {"forward": list(range(first - 1, last + 1)),
                  "backward": [n - k for k in range(a_first - 1, a_last + 1)]}
        out = {}
        for kind, points in (("forward", self.tape.forward_points),
                             ("backward", self.tape.backward_points)):
            inside = [p for p in wanted[kind] if 0 <= p <= n]
            if points and all(p in points for p in inside):
                like = points[inside[0]]
                out[(kind, *key)] = torch.stack([points[p] if 0 <= p <= n
                                                 else torch.zeros_like(like)
                                                 for p in wanted[kind]])
        return out

    def initial_norm(self, x: Tensor, keep: bool = True) -> Tensor | float:
        """The norm of a pass's given state (`keep`: a pass with gradients), what its
        residuals are relative to: a float, or in a captured pass a device scalar, as its
        residuals are (no host read)."""
        norm = torch.linalg.vector_norm(x)
        return norm if self._captured(keep) else float(norm)

    def _built(self, kind: str, key: tuple, solver: Solver) -> Solver:
        """A new solver, started from what its predecessor left (`set_configs`)."""
        rows = self._carried.pop((kind, *key[:3]), None)
        if rows is not None:
            solver.set_warm_states(rows)
        return solver

    def forward_solver(self, like: Tensor, keep: bool, inference: bool = False) -> Solver:
        """The forward solver for inputs like `like`: `keep` for passes with gradients (its
        states serve the backward pass), otherwise one of its own, with the inference
        options where `inference` (eval mode) and the forward options otherwise."""
        config = self.inference_config if (not keep and inference) else self.forward_config
        key = (tuple(like.shape), like.dtype, like.device, keep, config is self.inference_config)
        if key not in self.forward_solvers:
            prop = NetworkPropagator(self.layers, like, keep)
            solver = Solver(prop, like, self.num_steps, 0.0, self.t_final, config,
                            self.forward_comm, blocks=self.blocks,
                            final_sweep=prop.final_sweep)
            solver.captured = self._captured(keep)
            self.forward_solvers[key] = self._built("forward", key, solver) if keep else solver
        return self.forward_solvers[key]

    def adjoint_solver(self, like: Tensor) -> Solver:
        """The adjoint solver for cotangents like `like`, linearised at the states of the
        forward solver that keeps them."""
        key = (tuple(like.shape), like.dtype, like.device)
        if key not in self.adjoint_solvers:
            forward = self.forward_solver(like, keep=True)
            states, offset = forward.fine_states()
            prop = AdjointPropagator(self.layers, self.num_steps, self.backward_strides,
                                     states, offset, forward.prop.outputs,
                                     forward_fetches=forward.prop.fetches)
            solver = Solver(prop, like, self.num_steps, 0.0, self.t_final,
                            self.backward_config, self.backward_comm,
                            blocks=self.adjoint_blocks, final_sweep=prop.final_sweep)
            solver.captured = self.captured
            prop.skip_zero_rows = not self.captured
            self.adjoint_solvers[key] = self._built("backward", key, solver)
        return self.adjoint_solvers[key]

    def solve_forward(self, u0: Tensor, keep: bool, inference: bool) -> Result:
        """u_N from u_0 (no autograd graph; call under `torch.no_grad`)."""
        solver = self.forward_solver(u0, keep, inference)
        solver.prop.begin()
        return solver.solve(u0.detach())

    def solve_backward(self, grad_out: Tensor, grad_u0: bool = True
                       ) -> tuple[Result, list[tuple[list[int], dict[str, Tensor], float]]]:
        """The adjoint solve from dL/du_N, and the parameter cotangents its final fine sweep
        recorded (see `AdjointPropagator.gradients`); call under `torch.no_grad`.
        `grad_u0=False`: dL/du_0, the adjoint's final state, is not needed on any rank."""
        solver = self.adjoint_solver(grad_out)
        prop: AdjointPropagator = solver.prop
        prop.begin()
        res = solver.solve(grad_out.detach().contiguous(), final=grad_u0)
        if prop.outputs is not None:
            prop.outputs.clear()    # the forward pass's kept outputs are used up
        return res, prop.gradients

    def warm_states(self) -> dict[str, dict[tuple, Tensor | None]]:
        """What the solvers of warm-started passes start from next, per pass ("forward",
        "backward") and input (shape, dtype): what a checkpoint keeps so that a resumed run
        continues exactly. Forward passes without gradients are not warm-started from."""
        warm = {}
        for kind, solvers in (("forward", self.forward_solvers),
                              ("backward", self.adjoint_solvers)):
            cfg = self.forward_config if kind == "forward" else self.backward_config
            if cfg.initial_guess == "warm":
                warm[kind] = {key[:2]: s.warm_states() for key, s in solvers.items()
                              if s.has_solved and (kind == "backward" or key[3])}
        return warm

    def set_warm_states(self, warm: dict[str, dict[tuple, Tensor]],
                        device: torch.device) -> None:
        """Start the next passes from what `warm_states` returned (building their solvers
        for inputs on `device`)."""
        for kind, entries in warm.items():
            for (shape, dtype), rows in entries.items():
                like = torch.zeros(shape, dtype=dtype, device=device)
                solver = (self.forward_solver(like, keep=True) if kind == "forward"
                          else self.adjoint_solver(like))
                solver.set_warm_states(rows)
