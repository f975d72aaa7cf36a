"""A cycle's work on one rank, recorded once and replayed.

Once every relaxation phase of a rank is one compiled call (`CompiledPropagator`), a
multigrid cycle is a fixed sequence of calls: the compiled phases, the tensor operations
of restriction and correction on views kept per level pair, the posting and waiting of
boundary messages, and the solver's final-sweep hook. What decides that sequence (the
grid, the rank's points, the solver's options and which compiled program each phase
uses) does not change from cycle to cycle, nor from solve to solve, while the
propagator's program keys stay the same. So the first cycle records the calls as it
makes them, and later cycles replay the record: the Python that walks the levels and
phases, asks for programs and decides which messages flow runs once, not every cycle.
A replayed cycle makes the same calls on the same tensors in the same order as the
cycle it recorded, so its results are the same to the bit, and its messages are the
same ones.

A record is valid while the propagator's program keys are those it was made under: the
keys asked before the first final-sweep hook are asked again before every replay (a new
record is made where one differs), and those asked after a hook call are checked again
right after that call in the replay. A propagator's keys may change between cycles
(parameters in new storage, another strategy at a new solve) and at the final-sweep hook,
not otherwise (`CompiledPropagator`). A cycle where a phase runs step by step (a phase
the propagator does not compile, C-relaxation with a weight other than 1) is not
recorded; such a solver runs every cycle as before.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterator

if TYPE_CHECKING:
    from .level import Level


class _KeyCheck:
    """Program keys asked while recording, (level, parallel) -> key, asked again."""

    __slots__ = ("program_key", "keys")

    def __init__(self, program_key: Callable[[int, int], Hashable | None]) -> None:
        self.program_key = program_key
        self.keys: dict[tuple[int, int], Hashable | None] = {}

    def valid(self) -> bool:
        ask = self.program_key
        for (level, parallel), key in self.keys.items():
            now = ask(level, parallel)
            if now is not key and now != key:
                return False
        return True

    def __call__(self) -> None:
        if not self.valid():
            raise RuntimeError(
                "the propagator's program_key changed at its final-sweep hook in a way it "
                "did not when this cycle was recorded: keys may change between cycles and at "
                "the hook, but the keys after the hook must follow from those before it")


class Schedule:
    """The calls of one recorded cycle (`calls`, each without arguments), the program keys
    they were made under, and whether the cycle can be replayed (`replayable`: every phase
    ran as a compiled call). `depth` counts the recorded calls being made: a call made
    inside one (a level's message method that another calls, a compiled phase run by the
    solver's cached Phi) is part of it, not a call of its own."""

    __slots__ = ("calls", "checks", "replayable", "depth")

    def __init__(self, program_key: Callable[[int, int], Hashable | None]) -> None:
        self.calls: list[Callable[[], Any]] = []
        self.checks = [_KeyCheck(program_key)]
        self.replayable = True
        self.depth = 0

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Make the call fn(*args, **kwargs) and record it."""
        self.calls.append(partial(fn, *args, **kwargs) if args or kwargs else fn)
        self.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self.depth -= 1

    def hook(self, fn: Callable[[bool], None], active: bool) -> None:
        """Call and record the solver's final-sweep hook: the keys asked after it are
        checked again right after it in every replay."""
        self.call(fn, active)
        check = _KeyCheck(self.checks[0].program_key)
        self.checks.append(check)
        self.calls.append(check)

    def key(self, level: int, parallel: int, key: Hashable | None) -> None:
        """A program key asked while recording."""
        self.checks[-1].keys.setdefault((level, parallel), key)
        if key is None:
            self.replayable = False

    def valid(self) -> bool:
        """Whether the keys the record began under are still the propagator's."""
        return self.checks[0].valid()

    def replay(self) -> None:
        for call in self.calls:
            call()


class Replays:
    """A solver's record of its cycle: whether the next cycle is replayed (`replay`),
    recorded (`recording`) or run as it is. `schedule` is the record being replayed,
    `current` the one being made; `declined` a record that could not be replayed (a phase
    ran step by step): while its keys hold, cycles run as they are, not recorded again."""

    def __init__(self, levels: list[Level], enabled: bool) -> None:
        self.levels = levels
        self.enabled = enabled
        self.schedule: Schedule | None = None
        self.current: Schedule | None = None
        self.declined: Schedule | None = None

    def replay(self) -> bool:
        """Replay the record if one is valid; whether it was."""
        schedule = self.schedule
        if schedule is not None:
            if schedule.valid():
                schedule.replay()
                return True
            self.schedule = None
        return False

    def records(self) -> bool:
        """Whether the next cycle is to be recorded (else it runs as it is)."""
        declined = self.declined
        return self.enabled and (declined is None or not declined.valid())

    @contextmanager
    def recording(self, program_key: Callable[[int, int], Hashable | None]
                  ) -> Iterator[Schedule]:
        """Record the cycle made inside under the propagator's `program_key`: the levels
        record their calls in the schedule yielded; kept for replay if every phase was one
        compiled call, else declined. An error leaves no record and no level recording."""
        self.declined = None
        schedule = self.current = Schedule(program_key)
        for level in self.levels:
            level.recorder = schedule
        try:
            yield schedule
        finally:
            self.current = None
            for level in self.levels:
                level.recorder = None
        if schedule.replayable:
            self.schedule = schedule
        else:
            self.declined = schedule
