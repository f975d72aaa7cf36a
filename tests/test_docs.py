"""The documentation and the code agree."""

from pathlib import Path

from mgrit.app.settings import describe_keys

DOCS = Path(__file__).parent.parent / "docs"


def test_user_guide_lists_every_setting():
    guide = (DOCS / "user-guide.md").read_text()
    rows = [line for line in guide.splitlines() if line.startswith("| ")]
    for section, key, _ in describe_keys():
        assert any(f"| {key} |" in row and section in row.split("|")[1] for row in rows), \
            (section, key)
