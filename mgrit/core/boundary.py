"""The boundary messages of one level on one rank: the copy of the previous rank's last
point (the ghost, row 0 of u and of v) and the sending of this rank's last point.

Every operation that changes the rank's points ends with `changed`, which counts a new
version of the level and sends the last point to the next rank when it changed, and every
operation that reads the ghost first makes sure the latest copy has arrived
(`wait_ghost`). Which messages flow is decided by the grid alone, so both sides agree
without asking each other: after an F-phase (F-relaxation, sequential march) a rank sends
its last point when that point is an F-point; after a C-phase (C-relaxation, correction,
injection) when it is a C-point. The messages every cycle repeats are set up once
(persistent requests on MPI).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from ..comm import Comm, Persistent, Request, recv_init, send_init

if TYPE_CHECKING:
    from .level import Level
    from .schedule import Schedule

_U_TAG, _V_TAG = 0, 1


class Boundary:
    """The messages between one level's share on this rank and its neighbour ranks."""

    def __init__(self, level: Level, comm: Comm) -> None:
        local = level.local
        self.level = level
        self.comm = comm
        self.prev_rank, self.next_rank = local.prev_rank, local.next_rank
        self._last_row = level.u[-1] if level.count else None    # what `changed` sends
        self._last_v = (level.v[-1] if level.count and level.v is not None
                        else None)                                 # what `publish_v` sends
        self._state = (level.u.shape[1:], level.u.dtype, level.u.device)
        self._send_buf: dict[int, Tensor] = {}     # allocated at a kind's first send
        self._send_init: dict[int, Persistent] = {}
        self._recv_init: dict[int, Persistent] = {}
        self._sends: dict[int, Request] = {}
        self._recvs: dict[int, Request] = {}
        self._tags = (2 * level.index + _U_TAG, 2 * level.index + _V_TAG)
        # the phase (C True, F False) after which the ghost arrives and the last point
        # leaves; None where there is no previous or next rank
        grid = level.grid
        self._ghost_on = None if self.prev_rank is None else grid.is_c_point(level.first - 1)
        self._send_on = None if self.next_rank is None else grid.is_c_point(level.last)
        # the solver's record of the cycle being recorded (`mgrit.core.schedule`), else
        # None: the methods below record themselves in it
        self.recorder: Schedule | None = None

    # Each public method below does its work on this rank through a private method (or does
    # nothing, where the grid sends no message), by `_do`: while a cycle is recorded, the
    # private method is the call recorded, so that a replayed cycle makes one Python call
    # per message operation.
    def _do(self, fn: Callable[..., None], *args: object) -> None:
        """fn(*args), recorded as one call of the cycle being recorded, if any (not where
        it is made inside a recorded call)."""
        rec = self.recorder
        if rec is not None and not rec.depth:
            rec.call(fn, *args)
        else:
            fn(*args)

    def post_ghost(self, c_phase: bool) -> None:
        """Post the receive of the previous rank's last point for this phase."""
        if self._ghost_on == c_phase:
            self._do(self._post_u)

    def _post_u(self) -> None:
        self._wait(_U_TAG)
        self._recvs[_U_TAG] = self._receive(_U_TAG).start()

    def wait_ghost(self) -> None:
        if self.prev_rank is not None:    # else no ghost is ever received
            self._do(self._wait, _U_TAG)

    def _wait(self, kind: int) -> None:
        """Complete the receive of this kind in flight, if any."""
        req = self._recvs.pop(kind, None)
        if req is not None:
            req.wait()

    def touched(self) -> None:
        """u changed: results computed from an earlier version are stale."""
        self._do(self._touch)

    def _touch(self) -> None:
        self.level.version += 1

    def changed(self, c_phase: bool) -> None:
        """End of a phase that changed u (its C-points or F-points): count a new version and
        send the last point to the next rank if this phase changed it."""
        self._do(self._touch_send if self._send_on == c_phase else self._touch)

    def _touch_send(self) -> None:
        self.level.version += 1
        self._send(_U_TAG, self._last_row, self.next_rank)

    def post_v_ghost(self) -> None:
        if self.prev_rank is not None:
            self._do(self._post_v)

    def _post_v(self) -> None:
        self._recvs[_V_TAG] = self._receive(_V_TAG).start()

    def wait_v_ghost(self) -> None:
        if self.prev_rank is not None:
            self._do(self._wait, _V_TAG)

    def publish_v(self) -> None:
        if self.next_rank is not None:
            self._do(self._publish_v)

    def _publish_v(self) -> None:
        self._send(_V_TAG, self._last_v, self.next_rank)

    def _send(self, kind: int, value: Tensor, dest: int) -> None:
        previous = self._sends.pop(kind, None)
        if previous is not None:
            previous.wait()
        buf = self._send_buf.get(kind)
        if buf is None:
            shape, dtype, device = self._state
            buf = self._send_buf[kind] = torch.zeros(shape, dtype=dtype, device=device)
            self._send_init[kind] = send_init(self.comm, buf, dest, self._tags[kind])
        buf.copy_(value)
        self._sends[kind] = self._send_init[kind].start()

    def _receive(self, kind: int) -> Persistent:
        """The persistent receive of a kind of boundary value into its ghost row (set up at
        its first use)."""
        message = self._recv_init.get(kind)
        if message is None:
            ghost = self.level.u[0] if kind == _U_TAG else self.level.v[0]
            message = self._recv_init[kind] = recv_init(self.comm, ghost, self.prev_rank,
                                                        self._tags[kind])
        return message

    def drain(self) -> None:
        """Complete every message of this level still in flight."""
        if self.prev_rank is not None or self.next_rank is not None:
            self._do(self._drain)   # else a rank alone on the level: none is ever in flight

    def _drain(self) -> None:
        for req in list(self._recvs.values()) + list(self._sends.values()):
            req.wait()
        self._recvs.clear()
        self._sends.clear()
