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


def test_links_between_pages_resolve():
    """Every relative link in README.md and docs/*.md names a file that exists and, with
    '#anchor', a heading of that page (GitHub's anchors: lower case, punctuation dropped,
    spaces as hyphens)."""
    import re

    root = DOCS.parent
    pages = [root / "README.md", *sorted(DOCS.glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), (page.name, target)
            if anchor:
                headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
                anchors = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
                           for h in headings}
                assert anchor in anchors, (page.name, target)
