"""Progress of one training epoch on rank 0, for a terminal and for a pipe.

On a terminal (the stream is a tty) a bar is redrawn in place with ``\\r``, at most about
ten times a second, and never wider than the terminal less one column, so that it never
wraps. Anywhere else (a pipe or a file, which is what rank 0's stderr is under
``mpiexec``) plain lines are written: one at the first update, then one each time
``interval`` seconds have passed, and one at the close.

Fields are given structured and formatted here::

    loss 0.4312 acc 87.5% fwd 2 cyc 3.1e-04 bwd 1 cyc 8.0e-03 ctl 2/1 L3 gerr 0.112 12.3 ms/step
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any, Callable, TextIO

CLEAR = "\x1b[K"        # erase to the end of the line: leftovers of a longer previous line
REDRAW = 0.1            # seconds between two redraws of the bar on a terminal


def _forward_backward(name: str, cycles: Any, residual: Any) -> str | None:
    parts = [name]
    if cycles is not None:
        parts.append(f"{int(cycles)} cyc")
    if residual is not None:
        parts.append(f"{float(residual):.1e}")
    return " ".join(parts) if len(parts) > 1 else None


def _control(setting: Any, error: Any) -> str | None:
    """The controller's setting and the gradient error (probed or estimated)."""
    if setting is None:
        return None
    return f"ctl {setting}" + (f" gerr {float(error):.3f}" if error is not None else "")


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_fields(fields: dict[str, Any]) -> list[str]:
    """The fields as short pieces, in a fixed order for the known keys (`loss`, `acc`,
    `forward_cycles`/`forward_residual`, `backward_cycles`/`backward_residual`,
    `setting`/`gradient_error` (the controller's), `test_loss`, `test_acc`,
    `ms_per_step`), then the others as ``key value`` in their order. Missing keys and None
    values are left out."""
    f = fields
    pieces = [
        f"loss {float(f['loss']):.4f}" if f.get("loss") is not None else None,
        f"acc {float(f['acc']) * 100:.1f}%" if f.get("acc") is not None else None,
        _forward_backward("fwd", f.get("forward_cycles"), f.get("forward_residual")),
        _forward_backward("bwd", f.get("backward_cycles"), f.get("backward_residual")),
        _control(f.get("setting"), f.get("gradient_error")),
        f"test loss {float(f['test_loss']):.4f}" if f.get("test_loss") is not None else None,
        f"test acc {float(f['test_acc']) * 100:.2f}%" if f.get("test_acc") is not None
        else None,
        f"{float(f['ms_per_step']):.1f} ms/step" if f.get("ms_per_step") is not None
        else None,
    ]
    known = {"loss", "acc", "forward_cycles", "forward_residual", "backward_cycles",
             "backward_residual", "setting", "gradient_error", "test_loss", "test_acc",
             "ms_per_step"}
    pieces += [f"{key} {_value(value)}" for key, value in f.items()
               if key not in known and value is not None]
    return [p for p in pieces if p is not None]


class Progress:
    """Progress of epoch `epoch` of `epochs`, `total` steps long. See the module."""

    def __init__(self, enabled: bool, epoch: int, epochs: int, total: int,
                 label: str | None = None, stream: TextIO | None = None,
                 interval: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 width: int | None = None) -> None:
        self.enabled, self.epoch, self.epochs, self.total = enabled, epoch, epochs, total
        self.label, self.interval, self.clock, self.width = label, interval, clock, width
        self.stream = stream if stream is not None else sys.stderr
        try:
            self.tty = bool(self.stream.isatty())
        except (AttributeError, ValueError):    # no isatty, or a closed stream
            self.tty = False
        self.last: float | None = None          # clock at the last line written
        self.closed = False

    # the two layouts ----------------------------------------------------------------------
    def _head(self) -> str:
        return (f"[{self.label}] " if self.label else "") + f"epoch {self.epoch}/{self.epochs}"

    def plain(self, done: int, fields: dict[str, Any]) -> str:
        """The line written to a pipe or file."""
        return " ".join([self._head(), f"step {done}/{self.total}", *format_fields(fields)])

    def bar(self, done: int, fields: dict[str, Any], width: int) -> str:
        """The line drawn on a terminal `width` columns wide: at most width - 1 columns;
        the fields that do not fit are left out, whole, from the end; on a very narrow
        terminal the bar shrinks, then goes, then the line is cut."""
        room = max(width - 1, 0)
        head, counts = self._head(), f"{done}/{self.total}"
        inner = min(24, max(8, room // 8))
        fixed = len(head) + len(counts) + 4      # the spaces and the brackets
        if fixed + inner > room:
            inner = room - fixed
        if inner >= 3:
            filled = min(inner, inner * max(done, 0) // max(self.total, 1))
            line = f"{head} [{'#' * filled}{'.' * (inner - filled)}] {counts}"
        else:
            line = f"{head} {counts}"
        for piece in format_fields(fields):
            if len(line) + 1 + len(piece) > room:
                break
            line += " " + piece
        return line[:room]

    # drawing ------------------------------------------------------------------------------
    def _columns(self) -> int:
        if self.width is not None:
            return self.width
        return shutil.get_terminal_size(fallback=(80, 24)).columns

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def update(self, done: int, fields: dict[str, Any]) -> None:
        """Step `done` of `total` is over; `fields` describe it. Written if it is time."""
        if not self.enabled or self.closed:
            return
        now = self.clock()
        wait = REDRAW if self.tty else self.interval
        if self.last is not None and now - self.last < wait:
            return
        self.last = now
        if self.tty:
            self._write("\r" + self.bar(done, fields, self._columns()) + CLEAR)
        else:
            self._write(self.plain(done, fields) + "\n")

    def close(self, fields: dict[str, Any]) -> None:
        """The epoch is over: its last line, always written, with a newline."""
        if not self.enabled or self.closed:
            return
        self.closed = True
        if self.tty:
            self._write("\r" + self.bar(self.total, fields, self._columns()) + CLEAR + "\n")
        else:
            self._write(self.plain(self.total, fields) + "\n")
