"""`mgrit.app.progress.Progress`: the bar on a terminal, plain lines on a pipe."""

import io
import re
import sys

import pytest

from mgrit.app.progress import CLEAR, Progress, format_fields


class Stream(io.StringIO):
    """A stream that says whether it is a terminal, and counts its flushes."""

    def __init__(self, tty: bool):
        super().__init__()
        self.tty, self.flushes = tty, 0

    def isatty(self) -> bool:
        return self.tty

    def flush(self) -> None:
        self.flushes += 1
        super().flush()


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


LONG = {"loss": 0.431234, "acc": 0.875, "forward_cycles": 2, "forward_residual": 3.1e-4,
        "backward_cycles": 1, "backward_residual": 8.0e-3, "ms_per_step": 12.34,
        "learning_rate": 0.05, "note": "x" * 300}


def frames(text: str) -> list[str]:
    """What a terminal shows after each redraw: the text between carriage returns and
    newlines, with the erase-to-end-of-line code taken out."""
    return [f for f in re.split(r"[\r\n]", text.replace(CLEAR, "")) if f]


def make(tty: bool, **kwargs):
    stream, clock = Stream(tty), Clock()
    kwargs = {"label": "layer-parallel", "interval": 10.0, "width": 80, **kwargs}
    return Progress(True, 2, 10, 39, stream=stream, clock=clock, **kwargs), stream, clock


# fields -----------------------------------------------------------------------------------

def test_fields_formatted_compactly():
    assert " ".join(format_fields(LONG | {"note": "hi"})) == (
        "loss 0.4312 acc 87.5% fwd 2 cyc 3.1e-04 bwd 1 cyc 8.0e-03 12.3 ms/step "
        "learning_rate 0.05 note hi")


def test_fields_missing_and_none_left_out():
    assert format_fields({"loss": 1.5, "forward_cycles": 3, "forward_residual": None,
                          "backward_residual": None, "extra": None}) == [
        "loss 1.5000", "fwd 3 cyc"]
    assert format_fields({"forward_residual": 2e-5}) == ["fwd 2.0e-05"]
    assert format_fields({}) == []


def test_fields_epoch_summary():
    assert format_fields({"ms_per_step": 7.0, "test_acc": 0.9123, "loss": 0.25}) == [
        "loss 0.2500", "test acc 91.23%", "7.0 ms/step"]


# a terminal -------------------------------------------------------------------------------

@pytest.mark.parametrize("width", [40, 80, 200])
@pytest.mark.parametrize("label", [None, "layer-parallel"])
def test_tty_line_fits_terminal(width, label):
    progress, stream, clock = make(True, width=width, label=label)
    for step in range(1, 40):
        progress.update(step, LONG)
        clock.now += 1.0
    progress.close(LONG)
    shown = frames(stream.getvalue())
    assert len(shown) == 40
    assert all(len(f) <= width - 1 for f in shown), max(shown, key=len)
    assert all("\x1b" not in f for f in shown)
    assert all("/39" in f for f in shown)             # the counts always kept
    if width >= 80:
        assert all(re.search(r" \[[#.]{8,24}\] \d+/39", f) for f in shown)
        assert "] 1/39" in shown[0] and "] 39/39" in shown[-1]
        assert "#" * 8 in shown[-1]                    # the bar is full at the close
    if width == 200:
        assert "fwd 2 cyc 3.1e-04 bwd 1 cyc 8.0e-03 12.3 ms/step" in shown[0]


def test_tty_fields_cut_whole_from_the_end():
    progress, stream, _ = make(True, width=80)
    progress.update(5, LONG)
    shown = frames(stream.getvalue())[0]
    assert shown.startswith("[layer-parallel] epoch 2/10 [#")
    assert "5/39 loss 0.4312 acc 87.5%" in shown
    assert "x" not in shown.split("5/39")[1]           # the long note did not fit
    assert not shown.endswith(" ") and not re.search(r"\d\.\d*$|e-$", shown)


def test_tty_tiny_terminal_cut():
    progress, stream, _ = make(True, width=12)
    progress.update(5, LONG)
    progress.close(LONG)
    assert all(len(f) <= 11 for f in frames(stream.getvalue()))


def test_tty_redraw_in_place_clears_leftovers():
    progress, stream, clock = make(True, width=200)
    progress.update(1, {"note": "a long line " * 5})
    clock.now += 1
    progress.update(2, {"loss": 1.0})
    out = stream.getvalue()
    assert "\n" not in out
    assert out.count("\r") == 2 and out.count(CLEAR) == 2
    assert out.index(CLEAR, out.index("2/39")) > out.index("2/39")   # cleared after line 2
    assert stream.flushes == 2


def test_tty_throttled():
    progress, stream, clock = make(True)
    for step in range(1, 101):                         # 100 steps in 1 second
        progress.update(step, {"loss": 1.0})
        clock.now += 0.01
    drawn = frames(stream.getvalue())
    assert 9 <= len(drawn) <= 11
    assert drawn[0].split()[-3] == "1/39"              # the first update is drawn
    progress.close({"loss": 0.5})                      # the close is never throttled
    assert stream.getvalue().endswith("\n")
    assert frames(stream.getvalue())[-1].endswith("39/39 loss 0.5000")


def test_tty_terminal_width_read_at_each_redraw(monkeypatch):
    import shutil
    columns = iter([100, 30])
    monkeypatch.setattr(shutil, "get_terminal_size",
                        lambda fallback=(80, 24): type("S", (), {"columns": next(columns)}))
    progress, stream, clock = make(True, width=None)
    progress.update(1, LONG)
    clock.now += 1
    progress.update(2, LONG)
    first, second = frames(stream.getvalue())
    assert 80 < len(first) <= 99 and len(second) <= 29


# a pipe -----------------------------------------------------------------------------------

def test_pipe_first_then_each_interval_then_close():
    progress, stream, clock = make(False)
    for step in range(1, 40):                          # one step a second
        progress.update(step, {"loss": 1.0, "ms_per_step": 12.34})
        clock.now += 1.0
    assert stream.getvalue().splitlines() == [
        f"[layer-parallel] epoch 2/10 step {s}/39 loss 1.0000 12.3 ms/step"
        for s in (1, 11, 21, 31)]
    progress.close({"loss": 0.9, "test_acc": 0.5})
    lines = stream.getvalue().splitlines()
    assert lines[-1] == "[layer-parallel] epoch 2/10 step 39/39 loss 0.9000 test acc 50.00%"
    out = stream.getvalue()
    assert "\r" not in out and "\x1b" not in out and "#" not in out
    assert stream.flushes == 5                         # flushed after every line


def test_pipe_close_always_even_right_after_an_update():
    progress, stream, _ = make(False)
    progress.update(1, {})
    progress.close({})
    assert stream.getvalue() == ("[layer-parallel] epoch 2/10 step 1/39\n"
                                 "[layer-parallel] epoch 2/10 step 39/39\n")
    progress.update(2, {})                             # after the close: nothing
    progress.close({})
    assert stream.getvalue().count("\n") == 2


def test_pipe_lines_not_cut():
    progress, stream, _ = make(False, width=40)
    progress.update(1, LONG)
    assert "x" * 300 in stream.getvalue()


def test_label_tells_runs_apart():
    serial, s1, _ = make(False, label="serial")
    parallel, s2, _ = make(True, label="layer-parallel")
    serial.update(1, {})
    serial.close({})
    parallel.update(1, {})
    parallel.close({})
    assert all(line.startswith("[serial] epoch 2/10") for line in s1.getvalue().splitlines())
    assert all(f.startswith("[layer-parallel] epoch 2/10") for f in frames(s2.getvalue()))
    nolabel, s3, _ = make(False, label=None)
    nolabel.close({})
    assert s3.getvalue() == "epoch 2/10 step 39/39\n"


@pytest.mark.parametrize("tty", [True, False])
def test_disabled_prints_nothing(tty):
    stream, clock = Stream(tty), Clock()
    progress = Progress(False, 1, 3, 10, label="serial", stream=stream, clock=clock)
    for step in range(1, 11):
        progress.update(step, LONG)
        clock.now += 20
    progress.close(LONG)
    assert stream.getvalue() == "" and stream.flushes == 0


def test_default_stream_is_stderr_at_call_time(monkeypatch):
    stream = Stream(False)
    monkeypatch.setattr(sys, "stderr", stream)
    Progress(True, 1, 1, 4).close({"loss": 2.0})
    assert stream.getvalue() == "epoch 1/1 step 4/4 loss 2.0000\n"
