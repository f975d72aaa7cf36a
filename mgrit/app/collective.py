"""File-system work and loads that every rank of a run must agree on: done on rank 0 and
handed to all, or done on each and failed on all when any fails, so that one rank's
error ends every rank with its message instead of a hang or a bare abort."""

from __future__ import annotations

from typing import Any, Callable

from ..nn.checkpoint import FailedElsewhere
from .settings import SettingsError


def on_rank_zero(world: Any, fn: Callable[[], Any]) -> Any:
    """Run fn on rank 0 of `world` (an mpi4py communicator, or None) and hand its result
    (or its error) to every rank."""
    rank = world.Get_rank() if world is not None else 0
    result: Any = None
    if rank == 0:
        try:
            result = ("ok", fn())
        except (OSError, SettingsError) as err:  # raised again below, on every rank
            result = ("error", isinstance(err, SettingsError), str(err))
    if world is not None:
        result = world.bcast(result if rank == 0 else None, root=0)
    if result[0] == "error":
        raise (SettingsError if result[1] else OSError)(result[2])
    return result[1]


def agreed(world: Any, fn: Callable[[], Any]) -> Any:
    """fn() on every rank; if it fails on any, the same SettingsError on every rank,
    naming each failed rank and its error."""
    try:
        result, error = fn(), None
    except Exception as err:   # handed to every rank below, then raised there
        text = (str(err) if isinstance(err, (SettingsError, OSError, ValueError))
                else f"{type(err).__name__}: {err}")
        # a rank that only learnt that another failed adds nothing to that rank's message
        result, error = None, (text, isinstance(err, FailedElsewhere))
    errors = world.allgather(error) if world is not None else [error]
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return result
    if len(errors) == 1:
        raise SettingsError(failed[0][1][0])
    told = [(r, text) for r, (text, elsewhere) in failed if not elsewhere] or \
        [(r, text) for r, (text, _) in failed]
    by_message: dict[str, list[int]] = {}
    for r, text in told:
        by_message.setdefault(text, []).append(r)
    raise SettingsError("; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}"
        for m, rs in by_message.items()))

