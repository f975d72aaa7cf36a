"""The real-ranks study's bookkeeping (benchmarks.scaling.ranks), on made-up records: the
replay of each launch's traces against its measured time, the baselines and speedups, and
the rank counts a machine can run without oversubscribing its cores."""

import pytest

from benchmarks.scaling import ranks
from mgrit.app.replay import Interconnect

NETWORK = Interconnect(latency=1e-5, bandwidth=1e9, overhead=1e-6)


def _record(p: int, compute: float, measured: float) -> dict:
    """One launch's record: every rank computes `compute` seconds in its training step."""
    traces = [[[["compute", compute]] for _ in range(p)]]
    return {"mgrit": {"ranks": p, "w2": {"train": {"measured": [measured, measured * 1.2],
                                                    "traces": traces}}},
            "baselines": {"w2": {"serial pytorch": {"train": [0.09, 0.08]},
                                 "layer-wise model parallel": {"train": [0.1 * p]}}}}


def test_rows_replay_each_launch_and_compare_with_its_baselines():
    records = {1: _record(1, 0.010, 0.012), 4: _record(4, 0.004, 0.005)}
    rows = {r["ranks"]: r for r in ranks.table(records, NETWORK, workers=1, virtual=False)}
    assert set(rows) == {1, 4}
    one, four = rows[1], rows[4]
    assert one["measured"] == 0.012 and four["measured"] == 0.005       # fastest repeat
    assert one["predicted_from_mpi_traces"] == pytest.approx(0.010)
    assert four["error"] == pytest.approx(0.004 / 0.005 - 1)
    assert four["serial"] == 0.08 and four["layerwise"] == pytest.approx(0.4)
    assert four["speedup_vs_serial"] == pytest.approx(0.08 / 0.005)
    assert four["speedup_vs_layerwise"] == pytest.approx(0.4 / 0.005)
    assert four["efficiency"] == pytest.approx(0.012 / (4 * 0.005))
    assert "predicted_virtual" not in four


def test_rank_counts_past_the_cores_are_left_out(monkeypatch):
    launched = []

    class Done:
        def __init__(self, p):
            self.p = p

        def check(self):
            return self

        @property
        def reports(self):
            return {0: {"ranks": self.p}}

    def fake_run(p, args, timeout):
        launched.append(p)
        return Done(p)

    monkeypatch.setattr(ranks.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(ranks.launch, "run", fake_run)
    records = ranks.measure([1, 2, 4, 8, 16], ("w2",), 1, timeout=10)
    assert launched == [1, 2, 4] and sorted(records) == [1, 2, 4]


def test_bad_arguments_are_refused_before_any_launch(capsys):
    with pytest.raises(SystemExit):
        ranks.main(["out", "--cases", "w9"])
    assert "unknown case" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ranks.main(["out", "--ranks", "0,2"])
    assert "at least 1" in capsys.readouterr().err
