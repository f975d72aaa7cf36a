"""The figures of `mgrit compare` keep every label inside the picture and apart, and
every run's line visible when the runs agree; read from the drawn figures themselves."""

import itertools

import pytest

from mgrit.app import plot

plt = pytest.importorskip("matplotlib.pyplot")


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot functions draw (they close them when saved)."""
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    return figures


def _boxes(fig, artists):
    renderer = fig.canvas.get_renderer()
    return [a.get_window_extent(renderer) for a in artists]


def test_control_figure_labels_are_whole_and_apart(tmp_path, drawn):
    steps = [{"step": n, "forward_residuals": [1, 0.1], "backward_residuals": [1],
              "control": {"estimate": 0.1 + 0.001 * n, "forward_cycles": 2,
                          "backward_cycles": 1, "levels": 3 if n < 22 else 2}}
             for n in range(1, 121)]
    decisions = {1: "2/1 L3 warm", 11: "2/1 L3", 21: "2/1 L2", 51: "2/1 L2 warm", 61: "2/1 L2"}
    probes = [{"step": n, "error": 0.1 + 0.01 * (n % 7),
               **({"decision": {"to": decisions[n]}} if n in decisions else {})}
              for n in range(1, 121, 10)]
    plot.control_curves(steps, probes, 0.25, tmp_path / "control.png")
    fig = drawn[0]
    top, bottom = fig.axes
    labels = [t for t in top.texts if t.get_text() in decisions.values()]
    assert len(labels) == len(decisions)
    legends = [ax.get_legend() for ax in (top, bottom)]
    page = fig.bbox
    boxes = _boxes(fig, labels + legends)
    for box in boxes:     # nothing cut off at the figure's edges
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b)
    # the labels stand clear of the curves' area, the threshold inside it
    area = top.get_window_extent(fig.canvas.get_renderer())
    assert all(box.y0 >= area.y1 for box in boxes[:len(labels)])
    low, high = top.get_ylim()
    assert low < 0.1 and 0.25 < high


def test_agreeing_runs_both_stay_visible(tmp_path, drawn):
    epochs = [{"epoch": e, "train_loss": 1.0 / e} for e in (1, 2, 3)]
    plot.curves({"serial": epochs, "layer-parallel": epochs}, "train_loss", "loss",
                tmp_path / "loss.png")
    serial, parallel = drawn[0].axes[0].get_lines()
    assert (serial.get_label(), parallel.get_label()) == ("serial", "layer-parallel")
    # the same points: the one drawn on top is narrower and dashed, so the other shows
    assert list(serial.get_ydata()) == list(parallel.get_ydata())
    assert parallel.get_zorder() > serial.get_zorder()
    assert parallel.get_linewidth() < serial.get_linewidth()
    assert parallel.get_linestyle() != serial.get_linestyle()
    assert parallel.get_marker() != serial.get_marker()
