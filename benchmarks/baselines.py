"""The alternatives layer-parallel training is measured against, on the same network:

- layer-wise model parallelism: the layers split into contiguous blocks, one per rank; each
  rank waits for the previous one's output (forward) or the next one's gradient (backward);
- pipeline parallelism with micro-batches: torch.distributed.pipelining's GPipe schedule
  over gloo, the same blocks as stages.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import Tensor, nn


def split_blocks(network: nn.Sequential, ranks: int) -> list[nn.Sequential]:
    """Contiguous blocks of (opening, steps..., closing): the residual steps split as evenly
    as possible, the opening joining the first block and the closing the last."""
    modules = list(network)
    opening, steps, closing = modules[0], modules[1:-1], modules[-1]
    base, extra = divmod(len(steps), ranks)
    blocks, start = [], 0
    for r in range(ranks):
        count = base + (1 if r < extra else 0)
        part = steps[start:start + count]
        start += count
        if r == 0:
            part = [opening] + part
        if r == ranks - 1:
            part = part + [closing]
        blocks.append(nn.Sequential(*part))
    return blocks


def _inputs(blocks: list[nn.Sequential], x: Tensor) -> list[tuple[torch.Size, torch.dtype]]:
    """The input shape and dtype of every block (a dry run, no communication): the first
    block's may be token ids, the others' are states."""
    inputs = []
    with torch.no_grad():
        for block in blocks:
            inputs.append((x.shape, x.dtype))
            x = block(x)
    return inputs


class LayerwiseModelParallel:
    """One block of layers per rank of an mpi4py communicator, run one rank after the other.

    `train_step(x, y)` returns the loss on the last rank (None elsewhere) after updating the
    rank's own parameters; `forward(x)` returns the output on the last rank."""

    def __init__(self, network: nn.Sequential, comm: Any, example: Tensor,
                 loss_fn: Callable[[Tensor, Tensor], Tensor],
                 optimizer: Callable[[Any], torch.optim.Optimizer]) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        blocks = split_blocks(network, self.size)
        self.in_shape, self.in_dtype = _inputs(blocks, example)[self.rank]
        self.block = blocks[self.rank]
        self.loss_fn = loss_fn
        self.optimizer = optimizer(self.block.parameters())

    def _recv(self, shape: torch.Size, source: int, dtype: torch.dtype) -> Tensor:
        buf = torch.empty(shape, dtype=dtype)
        self.comm.Recv(buf.numpy(), source=source)
        return buf

    def forward(self, x: Tensor) -> Tensor | None:
        with torch.no_grad():
            u = x if self.rank == 0 else self._recv(self.in_shape, self.rank - 1, self.in_dtype)
            out = self.block(u)
            if self.rank < self.size - 1:
                self.comm.Send(out.contiguous().numpy(), dest=self.rank + 1)
                return None
            return out

    def train_step(self, x: Tensor, y: Tensor) -> float | None:
        self.optimizer.zero_grad()
        first, last = self.rank == 0, self.rank == self.size - 1
        u = (x if first else
             self._recv(self.in_shape, self.rank - 1, self.in_dtype).requires_grad_())
        out = self.block(u)
        if not last:
            self.comm.Send(out.detach().contiguous().numpy(), dest=self.rank + 1)
            grad = self._recv(out.shape, self.rank + 1, out.dtype)
            out.backward(grad)
            loss = None
        else:
            value = self.loss_fn(out, y)
            value.backward()
            loss = float(value.detach())
        if not first:
            self.comm.Send(u.grad.contiguous().numpy(), dest=self.rank - 1)
        self.optimizer.step()
        return loss


class GPipe:
    """torch.distributed.pipelining's GPipe schedule over gloo: the blocks of
    `split_blocks` as stages, the batch cut into `microbatches`."""

    def __init__(self, network: nn.Sequential, comm: Any, microbatches: int,
                 loss_fn: Callable[[Tensor, Tensor], Tensor],
                 optimizer: Callable[[Any], torch.optim.Optimizer]) -> None:
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", os.environ.get("MGRIT_GLOO_PORT", "29533"))
            dist.init_process_group("gloo", rank=self.rank, world_size=self.size)
        self.block = split_blocks(network, self.size)[self.rank]
        stage = PipelineStage(self.block, self.rank, self.size, torch.device("cpu"))
        self.schedule = ScheduleGPipe(stage, microbatches, loss_fn=loss_fn)
        self.optimizer = optimizer(self.block.parameters())

    def train_step(self, x: Tensor, y: Tensor) -> float | None:
        self.optimizer.zero_grad()
        losses: list[Tensor] = []
        if self.rank == 0 and self.size == 1:
            self.schedule.step(x, target=y, losses=losses)
        elif self.rank == 0:
            self.schedule.step(x)
        elif self.rank == self.size - 1:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        self.optimizer.step()
        return float(sum(loss.detach() for loss in losses) / len(losses)) if losses else None
