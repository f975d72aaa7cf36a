"""Exact passes on torch's own graph: where both passes of a training step are exact
sequential stepping (one level each) and the steps compute with torch's ops
(`ModuleSteps`: a transformer block, any module without mgrit's kernels), the forward
march runs under autograd, layer by layer, and the backward pass is one
`torch.autograd.grad` through the rank's layers.

The solvers would march forward without a graph and then, in the adjoint's march,
evaluate every layer again under autograd for its VJP: one forward evaluation more per
training step than serial PyTorch makes. Here the work is serial's own; so is the memory,
every layer's activations held from the forward pass to the backward one, where the
solvers hold the states alone. Strategies that keep their op outputs (mgrit's kernels)
already evaluate each layer once, and keep the solvers' march, which is faster than
torch's calls on such steps.

On several ranks the march is layer-wise model parallelism: rank r waits for the state of
rank r-1, marches its layers and sends its last state on; the backward pass comes back
the same way. The final state and dL/du_0 go to every rank, as a solve's do."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.func import functional_call

from ...comm import Comm, note_rank
from ...core.checks import check_u0
from .module_strategy import seeded
from .stack import LayerStack

# message tags on the tape's own communicator: states go up the ranks, cotangents down
_STATE, _COTANGENT = 1, 2


@dataclass
class _Taped:
    """One forward pass's graph: the state it started from (a leaf), the states after each
    layer, the leaves the backward pass differentiates by and what they stand for."""

    start: Tensor
    states: list[Tensor]
    params: dict[str, list[Tensor]]     # name -> per-layer leaf, of the trained names only
    context: dict[str, Tensor] = field(default_factory=dict)   # leaves of context tensors


class Tape:
    """Exact forward and backward passes over the layers of one rank, on torch's graph.

    comm: a communicator of the layer-parallel group for these passes alone (its messages
          never meet a solver's). Rank r marches its layers, from the point where rank r-1
          ends (the first layer of its stack) to where its own block ends.
    """

    def __init__(self, stack: LayerStack, comm: Comm, num_steps: int, t_final: float) -> None:
        self.stack = stack
        self.comm = comm
        self.dt = t_final / num_steps
        self._taped: _Taped | None = None
        # the states of the latest forward pass and the cotangents of the latest backward
        # pass at the rank's points (point -> detached tensor): what a solver that takes
        # over warm starts from (`Passes.set_configs`)
        self.forward_points: dict[int, Tensor] = {}
        self.backward_points: dict[int, Tensor] = {}

    @property
    def holds_graph(self) -> bool:
        """Whether a forward pass's graph waits for its backward pass."""
        return self._taped is not None

    def drop(self) -> None:
        """Free the graph of the latest forward pass (a solve took over)."""
        self._taped = None

    def forward(self, u0: Tensor, wanted: list[bool]) -> Tensor:
        """u_N from u_0 on every rank, keeping this rank's graph for `backward`. `wanted`:
        whether each parameter (in the stack's names) gets a gradient. u_0 must be finite,
        as a solve's must (checked on every rank, before any message)."""
        self._taped = None      # an older graph is freed before this one is built
        check_u0(u0, u0.shape, u0.dtype)
        try:
            return self._forward(u0, wanted)
        except Exception as err:
            note_rank(err, self.comm)
            raise

    def _forward(self, u0: Tensor, wanted: list[bool]) -> Tensor:
        stack, comm = self.stack, self.comm
        rank, size = comm.rank, comm.size
        if rank > 0:
            start = torch.empty_like(u0, memory_format=torch.contiguous_format)
            comm.irecv(start, rank - 1, _STATE).wait()
        else:
            start = u0.detach()
        layers = range(stack.first, stack.last + 1)
        # each layer's tensors, detached views of the stack's current storage; a leaf per
        # layer and trained parameter, so that each layer's gradient comes out on its own (a
        # row of one stacked leaf would give every layer a gradient of the whole stack)
        views = [{k: v.detach() for k, v in stack.layer_tensors(n).items()} for n in layers]
        params = {name: [v[name].requires_grad_() for v in views]
                  for name, want in zip(stack.names, wanted) if want}
        context = {k: (v.detach().requires_grad_() if v.requires_grad else v)
                   for k, v in stack.context.items()}
        with torch.enable_grad():
            # dL/d(the first state) always: ranks past the first send it back, and the
            # adjoint solver that may take over warm starts from it (`Passes.set_configs`)
            x = start.detach().requires_grad_()
            u, states = x, []
            for i, n in enumerate(layers):
                with stack.drawing(n), seeded(stack):
                    u = u + self.dt * functional_call(stack.template, views[i], (u,), context)
                states.append(u)
        self._taped = _Taped(x, states, params,
                             {k: v for k, v in context.items() if v.requires_grad})
        if rank < size - 1:
            comm.isend(u.detach().contiguous(), rank + 1, _STATE).wait()
        self.forward_points = {stack.first + i: s.detach()
                               for i, s in enumerate([x, *states])}
        if size == 1:
            return u.detach()
        final = (u.detach().contiguous() if rank == size - 1
                 else torch.empty_like(u0, memory_format=torch.contiguous_format))
        comm.bcast_(final, size - 1)
        return final

    def backward(self, grad_out: Tensor, input_grad: bool
                 ) -> tuple[Tensor | None, dict[str, Tensor], dict[str, Tensor]]:
        """(dL/du_0 on every rank where `input_grad`, else None; dL/dc of the context
        tensors that require grad, this rank's layers' part; dL/dtheta of the rank's layers,
        name -> stacked gradient) from dL/du_N, through the graph of the latest forward
        pass (used up: a second backward pass through it is refused)."""
        try:
            return self._backward(grad_out, input_grad)
        except Exception as err:
            note_rank(err, self.comm)
            raise

    def _backward(self, grad_out: Tensor, input_grad: bool
                  ) -> tuple[Tensor | None, dict[str, Tensor], dict[str, Tensor]]:
        taped = self._taped
        if taped is None:
            raise RuntimeError("backward through an exact pass whose graph is gone: a pass "
                               "of LayerParallel keeps its graph for one backward pass")
        self._taped = None
        stack, comm = self.stack, self.comm
        rank, size = comm.rank, comm.size
        if rank < size - 1:
            w = torch.empty_like(grad_out, memory_format=torch.contiguous_format)
            comm.irecv(w, rank + 1, _COTANGENT).wait()
        else:
            w = grad_out.detach()
        last = taped.states[-1]
        leaves = [p for rows in taped.params.values() for p in rows]
        context = list(taped.context.values())
        inner = taped.states[:-1]
        inputs = [*leaves, *context, *inner, taped.start]
        live = [t for t in inputs if t.requires_grad]
        found = (iter(torch.autograd.grad(last, live, w, allow_unused=True))
                 if last.requires_grad and live else iter(()))
        grads = [next(found, None) if t.requires_grad else None for t in inputs]
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]
        start_grad = grads.pop()
        if rank > 0:
            comm.isend(start_grad.contiguous(), rank - 1, _COTANGENT).wait()
        first = stack.first
        inner_grads = grads[len(grads) - len(inner):]
        self.backward_points = {first + i: g.detach()
                                for i, g in enumerate([start_grad, *inner_grads, w])}
        it = iter(grads)
        trained = {name: torch.stack([next(it) for _ in rows])
                   for name, rows in taped.params.items()}
        # frozen parameters: zeros, which only tied weights' sums read
        out = {name: trained[name] if name in trained else torch.zeros_like(tensor)
               for name, tensor in stack.tensors().items() if name in stack.names}
        context_grads = {name: next(it) for name in taped.context}
        grad_u0 = None
        if input_grad:
            grad_u0 = (start_grad.contiguous() if rank == 0
                       else torch.empty_like(grad_out, memory_format=torch.contiguous_format))
            if size > 1:
                comm.bcast_(grad_u0, 0)
        return grad_u0, context_grads, out
