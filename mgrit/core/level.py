"""One level's state storage on one rank, and the exchange of its boundary point.

Rows of `u` (and `v`, `g`) hold the rank's points first..last at rows 1..count;
row 0 is the ghost: a copy of point first-1, owned by the previous rank. Every
operation that changes the rank's points ends with `changed`, which counts a new
version of the level and sends the last point to the next rank when it changed,
and every operation that reads the ghost first makes sure the latest copy has
arrived (`wait_ghost`). Which messages flow is decided by the grid alone, so
both sides agree without asking each other: after an F-phase (F-relaxation,
sequential march) a rank sends its last point when that point is an F-point;
after a C-phase (C-relaxation, correction, injection) when it is a C-point.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable, Hashable

import torch
from torch import Tensor

from ..comm import Comm, Persistent, Request, recv_init, send_init
from .grid import LocalLevel
from .propagator import Step, StepBatch, make_step

if TYPE_CHECKING:
    from ..execute import Executor
    from .schedule import Schedule

# what a compiled phase is built from: its steps, per step (u, out, g), how many independent
PhaseSteps = tuple[list[Step], list[tuple[Tensor, Tensor, "Tensor | None"]], int]

_U_TAG, _V_TAG = 0, 1
_MISSING = object()


def _nothing() -> None:
    """The compiled phase of no steps (a rank's intervals without F-points)."""


class Level:
    """Storage and boundary exchange of one level on one rank."""

    def __init__(self, local: LocalLevel, like: Tensor, comm: Comm, t0: float, h: float,
                 fas: bool) -> None:
        self.local = local
        self.grid = local.grid
        self.index = local.grid.level
        self.first, self.last = local.first, local.last
        self.count = local.count
        self.empty = self.count == 0     # asked by every phase: an attribute, not a property
        self.offset = self.first - 1
        self.comm = comm
        self.t0, self.h = t0, h
        self.dt = h * self.grid.stride
        # a rank with no point on this level stores nothing (not even the ghost row)
        shape = (self.count + 1 if self.count else 0, *like.shape)
        self.u = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.v = torch.zeros_like(self.u) if fas else None
        self.g = torch.zeros_like(self.u) if fas else None
        self._state = (like.shape, like.dtype, like.device)
        self._send_buf: dict[int, Tensor] = {}     # allocated at a kind's first send
        # the messages every cycle repeats, set up once (persistent requests on MPI)
        self._send_init: dict[int, Persistent] = {}
        self._recv_init: dict[int, Persistent] = {}
        self._sends: dict[int, Request] = {}
        self._recvs: dict[int, Request] = {}
        self.version = 0   # bumped by every change of u, so results computed from it can be reused
        self._rows: tuple[list[Tensor], list[Tensor] | None] | None = None
        self._last_row = self.u[-1] if self.count else None    # what `changed` sends on
        self._last_v = self.v[-1] if self.count and fas else None   # what `publish_v` sends
        # the row that holds point 0, the initial value: the rank's own first row, or the
        # ghost where the rank's first point is point 1; None where it holds neither
        self.initial_row = (self.u[1] if self.count and self.first == 0 else
                            self.u[0] if self.count and self.first == 1 else None)
        self._steps: dict[int, Step] = {}
        # compiled relaxation phases by name, with the propagator key they were built for
        self._programs: dict[Hashable, tuple[Hashable, Callable[[], None] | None]] = {}
        self._compiled: dict[tuple[Hashable, Hashable], Callable[[], None] | None] = {}
        self._buffers: dict[Hashable, Tensor] = {}    # outputs of compiled phases
        # which phase moves the boundary points, fixed by the grid: asked at every phase
        self._tags = (2 * self.index + _U_TAG, 2 * self.index + _V_TAG)
        # the phase (C True, F False) after which the ghost arrives and the last point
        # leaves; None where there is no previous or next rank
        self._ghost_on = (None if local.prev_rank is None
                          else self.grid.is_c_point(self.first - 1))
        self._send_on = None if local.next_rank is None else self.grid.is_c_point(self.last)
        # the solver's record of the cycle being recorded (`mgrit.core.schedule`), else
        # None: the methods that change u or move messages record themselves in it
        self.recorder: Schedule | None = None

    # index maths -----------------------------------------------------------

    def row_views(self) -> tuple[list[Tensor], list[Tensor] | None]:
        """One view per row of u and of g (None on level 0), made at the first march of
        this level and kept (u and g are never reallocated): a march takes one step at a
        time and would otherwise make two views per step. Not made up front: a level that
        is never marched (the fine levels of a serial solve) would pay for a view per point
        at every Solver construction."""
        if self._rows is None:
            self._rows = (list(self.u), None if self.g is None else list(self.g))
        return self._rows

    def row(self, j: int) -> int:
        return j - self.offset

    def step(self, index: int) -> Step:
        """The step from point `index` to `index + 1` on this level."""
        step = self._steps.get(index)
        if step is None:
            step = self._steps[index] = make_step(self.index, index, self.grid.stride, self.t0,
                                                  self.h)
        return step

    def batch(self, start: int, stride: int, count: int) -> StepBatch:
        return StepBatch(self.index, start, stride, count, self.grid.stride, self.t0, self.h)

    def program(self, name: Hashable, executor: "Executor", parallel: int,
                build: Callable[[], PhaseSteps]) -> Callable[[], None] | None:
        """Phase `name` of this level, `parallel` of whose steps are independent, as one
        compiled call of the propagator (`CompiledPropagator`), built by `build` at its
        first use and again when the propagator's key changes (a phase of no steps is a
        call that does nothing); None where the phase runs step by step (no compiled
        phases, CUDA graphs, another executor, or the propagator declines). While a cycle
        is recorded, the program returned records its calls."""
        caps = executor.caps
        if (caps.program_key is None or caps.step_program is None or not executor.compiles
                or executor.graphs is not None):
            return None
        key = caps.program_key(self.index, parallel)
        rec = self.recorder
        if rec is not None:
            rec.key(self.index, parallel, key)
        if key is None:
            return None
        entry = self._programs.get(name)
        if entry is None or (entry[0] is not key and entry[0] != key):
            # a phase may alternate between keys (the fine level's final sweep keeps op
            # outputs, its other sweeps do not): every key's program is kept
            program = self._compiled.get((name, key), _MISSING)
            if program is _MISSING:
                steps, rows, parallel = build()
                program = self._compiled[(name, key)] = (
                    caps.step_program(steps, rows, parallel) if steps else _nothing)
            entry = self._programs[name] = (key, program)
        program = entry[1]
        if rec is not None:
            if program is None:
                rec.replayable = False
            elif not rec.depth and program is not _nothing:
                return partial(rec.call, program)
        return program

    def step_by_step(self) -> None:
        """A phase of this level runs step by step: the cycle being recorded, if any, is
        not replayable."""
        if self.recorder is not None:
            self.recorder.replayable = False

    def buffer(self, name: Hashable, count: int) -> Tensor:
        """A tensor of `count` states kept for phase `name`'s output (allocated once)."""
        buf = self._buffers.get(name)
        if buf is None:
            shape, dtype, device = self._state
            buf = self._buffers[name] = torch.empty((count, *shape), dtype=dtype,
                                                    device=device)
        return buf

    def rows(self, first_j: int, stride: int, count: int) -> slice:
        """Rows of the points first_j, first_j + stride, ... (count of them)."""
        start = first_j - self.offset
        return slice(start, start + stride * (count - 1) + 1, stride)

    def c_points(self, skip_zero: bool = True) -> tuple[int, int]:
        """(first C-point, number of C-points) in the rank's range; point 0 left out
        when `skip_zero`, for operations that never change the initial value."""
        m = self.grid.coarsening or (self.grid.num_steps + 1)
        first_c = -(-self.first // m) * m
        if skip_zero and first_c == 0:
            first_c = m
        count = (self.last - first_c) // m + 1 if self.last >= first_c else 0
        return first_c, count

    def tag(self, kind: int) -> int:
        return self._tags[kind]

    # boundary exchange -----------------------------------------------------
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
        if self.local.prev_rank is not None:    # else no ghost is ever received
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
        self.version += 1

    def changed(self, c_phase: bool) -> None:
        """End of a phase that changed u (its C-points or F-points): count a new version and
        send the last point to the next rank if this phase changed it."""
        self._do(self._touch_send if self._send_on == c_phase else self._touch)

    def _touch_send(self) -> None:
        self.version += 1
        self._send(_U_TAG, self._last_row, self.local.next_rank)

    def post_v_ghost(self) -> None:
        if self.local.prev_rank is not None:
            self._do(self._post_v)

    def _post_v(self) -> None:
        self._recvs[_V_TAG] = self._receive(_V_TAG).start()

    def wait_v_ghost(self) -> None:
        if self.local.prev_rank is not None:
            self._do(self._wait, _V_TAG)

    def publish_v(self) -> None:
        if self.local.next_rank is not None:
            self._do(self._publish_v)

    def _publish_v(self) -> None:
        self._send(_V_TAG, self._last_v, self.local.next_rank)

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
            buf = self.u[0] if kind == _U_TAG else self.v[0]
            message = self._recv_init[kind] = recv_init(self.comm, buf, self.local.prev_rank,
                                                        self._tags[kind])
        return message

    def drain(self) -> None:
        """Complete every message of this level still in flight."""
        if self.local.prev_rank is not None or self.local.next_rank is not None:
            self._do(self._drain)   # else a rank alone on the level: none is ever in flight

    def _drain(self) -> None:
        for req in list(self._recvs.values()) + list(self._sends.values()):
            req.wait()
        self._recvs.clear()
        self._sends.clear()
