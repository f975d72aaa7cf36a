"""The docs' generated tables: a rewrite replaces what lies between a table's markers and
nothing else, and the published pages hold what their JSON records say."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.scaling import docs

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "docs" / "results"
PAGES = [ROOT / "docs" / f"{n}.md" for n in ("scaling", "results", "performance")]


def outside(text: str) -> str:
    """`text` with every generated section's body removed: what a rewrite must keep."""
    return re.sub(r"(<!-- begin generated: [a-z0-9.-]+ -->\n).*?(<!-- end generated -->)",
                  r"\1\2", text, flags=re.S)


def test_a_hand_written_section_survives_a_rewrite(tmp_path):
    page = tmp_path / "scaling.md"
    hand = ("## Real ranks past two: 16 cores\n\nA table no tool writes:\n\n| P | ms |\n"
            "|---|---|\n| 16 | 15.9 |\n")
    original = (ROOT / "docs" / "scaling.md").read_text()
    # stale tables in every section, and a hand-written section among them
    stale = re.sub(r"(<!-- begin generated: [a-z0-9.-]+ -->\n).*?(<!-- end generated -->)",
                   r"\1| stale |\n\2", original, flags=re.S)
    anchor = "## Predicted speedups"
    assert anchor in stale
    page.write_text(stale.replace(anchor, hand + "\n" + anchor, 1))
    written = docs.update(page, RESULTS)
    text = page.read_text()
    assert hand in text
    assert "| stale |" not in text
    assert outside(text) == outside(stale.replace(anchor, hand + "\n" + anchor, 1))
    assert set(written) == set(docs.generated_names(original))


def test_the_published_tables_are_their_records(tmp_path):
    """Rewriting a page from docs/results changes nothing: its tables are up to date."""
    for source in PAGES:
        copy = tmp_path / source.name
        copy.write_text(source.read_text())
        docs.update(copy, RESULTS)
        assert copy.read_text() == source.read_text(), source.name


def test_the_sixteen_rank_table_holds_the_measured_runs():
    """Against ranks-h200.json read here: every measured row is in docs/scaling.md."""
    record = json.loads((RESULTS / "ranks-h200.json").read_text())
    page = (ROOT / "docs" / "scaling.md").read_text()
    assert "## Real ranks past two: 16 cores" in page
    page = page.split("## Real ranks past two: 16 cores")[1].split("\n## ")[0]
    for row in record["rows"]:
        cells = f"| {row['case'].upper()} | {row['metric']} | {row['ranks']} |"
        line = next(line for line in page.splitlines() if line.startswith(cells))
        assert f"{row['measured'] * 1e3:.2f} ms" in line
        assert f"{row['layerwise'] * 1e3:.2f} ms" in line
    assert max(r["ranks"] for r in record["rows"]) == 16


def test_missing_or_unknown_markers_are_errors(tmp_path):
    with pytest.raises(ValueError, match="no section 'curve-w2'"):
        docs.replace_generated("text\n", "curve-w2", "| x |")
    with pytest.raises(ValueError, match="no '<!-- end generated -->'"):
        docs.replace_generated("<!-- begin generated: a -->\nx\n<!-- begin generated: b -->\n"
                               "<!-- end generated -->\n", "a", "| x |")
    page = tmp_path / "p.md"
    page.write_text("<!-- begin generated: no-such-table -->\n<!-- end generated -->\n")
    with pytest.raises(ValueError, match="no-such-table"):
        docs.update(page, RESULTS)
    assert page.read_text().count("\n") == 2


def test_the_study_rewrites_only_its_own_tables(tmp_path):
    """`--docs` after the study rewrites the sections of scaling.json, not the 16-rank table
    (written from another machine's record)."""
    page = tmp_path / "scaling.md"
    stale = re.sub(r"(<!-- begin generated: [a-z0-9.-]+ -->\n).*?(<!-- end generated -->)",
                   r"\1| stale |\n\2", (ROOT / "docs" / "scaling.md").read_text(), flags=re.S)
    page.write_text(stale)
    written = docs.update(page, RESULTS, {"scaling.json"})
    assert "curve-w2" in written and "ranks-h200" not in written
    body = page.read_text().split("<!-- begin generated: ranks-h200 -->\n")[1]
    assert body.startswith("| stale |")


def test_a_device_runs_tables_are_written_from_its_records(tmp_path):
    """Sections named by a device run's GPU take its records: gpu_check's own speed table
    and targets from gpu-DEVICE.json, the real-rank table from ranks-DEVICE.json."""
    from benchmarks import gpu_check

    dry = json.loads((RESULTS / "gpu-h200.json").read_text())
    record = {"environment": dry["environment"], "workloads": {"w2": "W2"},
              "settings": {"repeats": 5},
              "speed": [{"workload": "w2", "method": method, "metric": "train_step",
                         "status": "measured", "seconds": seconds, "first_call_seconds": 1.0,
                         "update_error": 0.0}
                        for method, seconds in (("serial pytorch, cuda graph", 0.02),
                                                ("serial pytorch", 0.2),
                                                ("mgrit captured step", 0.004))],
              "unmeasured": []}
    (tmp_path / "gpu-h100-80gb-hbm3.json").write_text(json.dumps(record))
    (tmp_path / "ranks-h100-80gb-hbm3.json").write_text(
        (RESULTS / "ranks-h200.json").read_text())
    page = tmp_path / "results.md"
    page.write_text("".join(f"<!-- begin generated: {name}-h100-80gb-hbm3 -->\n| stale |\n"
                            "<!-- end generated -->\n" for name in ("gpu", "gpu-targets",
                                                                     "ranks")))
    assert docs.update(page, tmp_path) == [f"{name}-h100-80gb-hbm3"
                                           for name in ("gpu", "gpu-targets", "ranks")]
    text = page.read_text()
    assert gpu_check.speed_table(record) in text and gpu_check.targets_table(record) in text
    assert docs.ranks_table(json.loads((RESULTS / "ranks-h200.json").read_text())) in text
    assert "| mgrit captured step | 0.20 | 0.0e+00 | met |" in text
    assert "| stale |" not in text
