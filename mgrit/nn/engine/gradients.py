"""Parameter gradients of a layer-parallel network: dL/dtheta of a rank's layers, assembled
from what the adjoint solve recorded, and their mean over data-parallel replicas."""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from ...comm import Comm
from .stack import LayerStack


def _progression(rows: list[int]) -> tuple[int, int] | None:
    """(first, step) where rows is an arithmetic progression of distinct values, else None."""
    if not rows:
        return None
    step = rows[1] - rows[0] if len(rows) > 1 else 1
    if step == 0 or rows != list(range(rows[0], rows[-1] + step, step)):
        return None
    return rows[0], step


def _grid(rows: list[int]) -> tuple[int, int, int, int, int] | None:
    """(first, p, q, a, b) where rows[i q + j] = first + i a + j b for i < p, j < q, with
    a, b > 0 and no row twice (F-relaxation's batches: the F-points of consecutive
    intervals, interval by interval), else None."""
    if len(rows) < 2 or rows[1] <= rows[0]:
        return None
    b = rows[1] - rows[0]
    q = 2
    while q < len(rows) and rows[q] - rows[q - 1] == b:
        q += 1
    if len(rows) % q or q == len(rows):
        return None
    p, a = len(rows) // q, rows[q] - rows[0]
    first = rows[0]
    if a <= 0 or len(set(rows)) != len(rows) or rows != [first + i * a + j * b
                                                       for i in range(p) for j in range(q)]:
        return None
    return first, p, q, a, b


def _place(local: list[int]) -> tuple | None:
    """Where rows `local` of the gradient are as one strided view: ("slice", slice,
    descending) or ("grid", first, p, q, a, b); None if they are neither."""
    line = _progression(local)
    if line is not None:
        first, step = line
        last = local[-1]
        return "slice", slice(min(first, last), max(first, last) + 1, abs(step)), step < 0
    grid = _grid(local)
    return None if grid is None else ("grid", *grid)


def _pieces(local: list[int]) -> list[tuple[int, int, tuple]]:
    """A batch's rows as (start, stop, place) runs: the whole batch as one view where it is
    one; else a view of all but a few rows at either end (a rank whose first interval began
    on the rank before records that interval's last F-points with its own intervals), those
    few rows each a view too; else one index of them all."""
    whole = _place(local)
    if whole is not None:
        return [(0, len(local), whole)]
    n = len(local)
    if len(set(local)) == n:          # distinct rows: the pieces' order does not matter
        for head, tail in sorted(((h, t) for h in range(4) for t in range(4) if h or t),
                                 key=sum):
            middle = _place(local[head: n - tail]) if n - head - tail >= 2 else None
            if middle is None or middle[0] != "grid":
                continue
            runs = [(a, b, _place(local[a:b])) for a, b in ((0, head), (head, n - tail),
                                                             (n - tail, n)) if b > a]
            if all(place is not None for _, _, place in runs):
                return runs
    return [(0, n, ("index", torch.tensor(local, dtype=torch.long)))]


class _Plan:
    """Where a backward solve's recorded batches go in the stacked gradients, worked out
    once for a sequence of batches: the adjoint's compiled phases record the same layer
    lists (the same list objects) at every backward pass, and finding a batch's rows in
    Python costs more than copying its cotangents (a list of a thousand layers). A batch's
    rows are a strided view of the gradient where they can be (an indexed copy moves data
    several times slower than a strided one), else an index."""

    __slots__ = ("batches", "once", "pieces", "_buffers", "_indices")

    def __init__(self, layers: LayerStack, batches: list[list[int]]) -> None:
        lo, count = layers.first, layers.count
        rows = [layer - lo for batch in batches for layer in batch]
        reached = set(rows)
        if not reached.issuperset(range(count)):
            missing = [lo + r for r in sorted(set(range(count)) - reached)]
            raise RuntimeError(f"the adjoint's final fine sweep did not reach layers {missing}")
        self.batches = batches        # held, so that identity comparisons stay meaningful
        self.once = len(rows) == count
        # one piece per run of a batch's rows that goes to the gradient in one copy:
        # (batch, first row of the batch, end row, where the rows go)
        self.pieces: list[tuple[int, int, int, tuple]] = []
        for k, batch in enumerate(batches):
            local = [layer - lo for layer in batch]
            for start, stop, place in _pieces(local):
                self.pieces.append((k, start, stop, place))
        self._buffers: dict[tuple[int, str], Tensor] = {}
        self._indices: dict[tuple[int, torch.device], Tensor] = {}

    @property
    def places(self) -> list[tuple]:
        """Where each piece's rows go, in order."""
        return [piece[3] for piece in self.pieces]

    def buffer(self, k: int, name: str, like: Tensor) -> Tensor:
        """A tensor like `like` kept for piece k's cotangents of parameter `name`."""
        buf = self._buffers.get((k, name))
        if (buf is None or buf.shape != like.shape or buf.dtype != like.dtype
                or buf.device != like.device):
            buf = self._buffers[(k, name)] = torch.empty_like(like)
        return buf

    def index(self, k: int, index: Tensor, device: torch.device) -> Tensor:
        """Piece k's row index on `device`, copied there once: a copy from the host at
        every pass would be a host transfer inside a captured step."""
        on = self._indices.get((k, device))
        if on is None:
            on = self._indices[(k, device)] = index.to(device)
        return on

    def fits(self, batches: list[list[int]]) -> bool:
        return len(batches) == len(self.batches) and all(map(operator.is_, batches,
                                                             self.batches))


def _rows(grad: Tensor, place: tuple, cot: Tensor) -> tuple[Tensor, Tensor] | None:
    """(the rows of `grad` that a batch's cotangents go to, the cotangents shaped alike),
    or None where they go by index."""
    kind = place[0]
    if kind == "slice":
        return grad[place[1]], (cot.flip(0) if place[2] else cot)
    if kind == "grid":
        first, p, q, a, b = place[1:]
        rest, stride = grad.shape[1:], grad.stride()
        view = grad.as_strided((p, q, *rest), (a * stride[0], b * stride[0], *stride[1:]),
                               grad.storage_offset() + first * stride[0])
        return view, cot.reshape(p, q, *rest)
    return None


# the plan of each stack's latest backward pass
_PLANS: "weakref.WeakKeyDictionary[LayerStack, _Plan]" = weakref.WeakKeyDictionary()


def layer_gradients(layers: LayerStack,
                    recorded: list[tuple[list[int], dict[str, Tensor], float]]
                    ) -> dict[str, Tensor]:
    """dL/dtheta of the owned layers (parameter name -> stacked gradient), as the adjoint's
    final fine sweep recorded them (its one VJP per layer, at final values, gives both w_n
    and dL/dtheta_n); where a layer was recorded twice, the later entry counts. The recorded
    layer lists must not change once recorded (their rows are worked out once, `_Plan`)."""
    batches = [batch for batch, _, _ in recorded]
    plan = _PLANS.get(layers)
    if plan is None or not plan.fits(batches):
        plan = _PLANS[layers] = _Plan(layers, batches)
    params = {name: layers.params[name.replace(".", "__")] for name in layers.names}
    # every row is written below; zeroed first only where some row is written twice
    blank = torch.empty_like if plan.once else torch.zeros_like
    grads = {name: blank(param) for name, param in params.items()}
    for piece, (k, start, stop, place) in enumerate(plan.pieces):
        _, cotangents, dt = recorded[k]
        whole = start == 0 and stop == len(recorded[k][0])
        for name, grad in grads.items():
            cot = cotangents[name] if whole else cotangents[name][start:stop]
            pair = _rows(grad, place, cot)
            if pair is not None:
                torch.mul(pair[1], dt, out=pair[0])
            else:
                # scaled in a buffer kept with the plan: a fresh temporary the size of the
                # batch's cotangents costs its first touch at every pass
                grad.index_copy_(0, plan.index(piece, place[1], cot.device),
                                 torch.mul(cot, dt, out=plan.buffer(piece, name, cot)))
    return grads


def average_gradients(parameters: Iterable[nn.Parameter], data_comm: Comm) -> None:
    """Mean of the gradients over data-parallel replicas: one allreduce of one buffer."""
    params = [p for p in parameters if p.requires_grad]
    if not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params])
    data_comm.allreduce_sum_(flat)
    flat /= data_comm.size
    offset = 0
    for p in params:
        n = p.numel()
        grad = flat[offset: offset + n].view_as(p)
        if p.grad is None:
            p.grad = grad.clone()
        else:
            p.grad.copy_(grad)
        offset += n


def context_gradients(recorded: list[tuple[list[int], dict[str, Tensor], float]],
                      context: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """dL/dc of the context tensors that require grad, summed over this rank's layers: each
    layer's cotangent (recorded under `prefix + name`, one row per layer of a batch; a layer
    recorded twice counts once, its later entry; a batch without an entry contributed
    zeros) times its step size."""
    live = [name for name, value in context.items() if value.requires_grad]
    if not live:
        return {}
    rows: dict[int, dict[str, Tensor | None]] = {}
    for batch, cotangents, dt in recorded:
        for i, layer in enumerate(batch):
            rows[layer] = {name: (cotangents[prefix + name][i] * dt
                                  if prefix + name in cotangents else None)
                           for name in live}
    out = {}
    for name in live:
        total = torch.zeros_like(context[name])
        for entry in rows.values():
            if entry[name] is not None:
                total += entry[name]
        out[name] = total
    return out
