"""`make demo`'s deep-network speed table (`compare.deep_speed`) and the sentences that say
how to read the demo's tables. No timing is asserted: only that both timings are measured,
written and reported consistently."""

import json

import pytest

from mgrit.app import compare
from mgrit.app.settings import Settings

from conftest import mpiexec_path


def _rows(ratio, gap_pp=0.2, ranks=2):
    return {"serial": {"ranks": 1, "time_ratio_to_serial": 1.0, "accuracy_difference_pp": 0.0},
            "layer-parallel": {"ranks": ranks, "time_ratio_to_serial": ratio,
                               "accuracy_difference_pp": gap_pp}}


def test_accuracy_table_sentence_follows_the_numbers():
    s = Settings()
    slow = compare.reading(_rows(3.3, -0.19), s)
    assert slow.startswith("Same data, seed and batch order: the test accuracies agree to "
                           "within 0.19 points;")
    assert "3.3x serial's here because 32 layers on 2 ranks leave MGRIT little" in slow
    fast = compare.reading(_rows(0.5, 4.0), s)
    assert "differ by 4.00 points" in fast and "0.50x serial's here." in fast
    assert "little to parallelize" not in fast
    s.network.steps = 1024                   # many layers: no reason given for a slower step
    deep = compare.reading(_rows(1.2), s)
    assert "is 1.20x serial's here." in deep and "little to parallelize" not in deep


def test_deep_table_sentence_follows_the_numbers():
    faster = compare.deep_reading(_rows(0.25), 1024)
    assert faster.startswith("A deep narrow network (1024 layers): MGRIT advances all "
                             "intervals of a level in one batched call")
    assert "0.25x serial's time per step (4.0x faster) on 2 ranks" in faster
    slower = compare.deep_reading(_rows(1.4), 1024)
    assert "took 1.40x serial's time per step" in slower and "faster" not in slower


@pytest.mark.mpi
def test_deep_speed_writes_both_timings_and_their_ratio(tmp_path, capsys):
    mpiexec_path()
    settings = Settings()
    settings.data.test_fraction = 0.9        # digits: 180 training images, 5 full batches
    settings.output.progress = False
    before = settings.as_dict()
    out = tmp_path / "demo"
    result = compare.deep_speed(settings, out, ranks=2, steps=128)

    saved = json.loads((out / "deep.json").read_text())
    assert saved["runs"] == json.loads(json.dumps(result["runs"]))
    runs = saved["runs"]
    assert set(runs) == {"serial", "layer-parallel"}
    serial, lp = runs["serial"], runs["layer-parallel"]
    assert (serial["ranks"], lp["ranks"]) == (1, 2)
    assert serial["training_steps"] == lp["training_steps"] == 5
    assert serial["ms_per_step"] > 0 and lp["ms_per_step"] > 0
    assert saved["layer_parallel_to_serial"] == pytest.approx(
        lp["ms_per_step"] / serial["ms_per_step"])
    assert lp["time_ratio_to_serial"] == saved["layer_parallel_to_serial"]
    deep = saved["settings"]
    assert (deep["network"]["kind"], deep["network"]["width"], deep["network"]["steps"],
            deep["training"]["epochs"]) == ("dense", 32, 128, 1)
    assert deep["forward"]["levels"] == deep["backward"]["levels"] == compare.DEEP_LEVELS
    # the caller's settings are left as they were
    assert settings.as_dict() == before
    for label in ("serial", "layer-parallel"):
        assert (out / "deep" / label / "metrics.jsonl").is_file()

    table = (out / "deep.md").read_text()
    ratio = saved["layer_parallel_to_serial"]
    assert f"| serial | 1 | {serial['ms_per_step']:.1f} | 1.00 |" in table
    assert f"| layer-parallel | 2 | {lp['ms_per_step']:.1f} | {ratio:.2f} |" in table
    assert "A deep narrow network (128 layers): " in table
    assert f"{ratio:.2f}x serial's time per step" in table
    assert table in capsys.readouterr().out
