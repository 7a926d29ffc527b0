"""The README and the user guide show working things: every relative link reaches a file (and,
for #anchors, a heading), and the examples they show are the shipped files and valid jobs.
In-process and fast: no job is launched."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import mpips

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(
    [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "slurm/README.md"]
    + list((ROOT / "docs").rglob("*.md"))
)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file (the slug of each heading's text)."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """Each relative link of a markdown file whose file or #anchor does not exist."""
    bad = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return bad


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_a_heading(path):
    assert broken_links(path) == []


def test_the_readme_is_a_front_door():
    """A quick start, not the manual: the rest lives in docs/, and the README links it."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 300
    assert "docs/README.md" in readme
    for page in (ROOT / "docs/guide").glob("*.md"):
        assert f"guide/{page.name}" in (ROOT / "docs/README.md").read_text(), page.name


def test_the_readme_example_is_the_shipped_file():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Your own model")
    section = readme[start : readme.index("\n## ", start + 1)]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert code in (ROOT / "jobs/my_model.py").read_text()


def test_the_data_examples_are_valid_jobs():
    page = (ROOT / "docs/guide/data.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", page, re.S)
    assert blocks
    for block in blocks:
        mpips.parse_job(block + "[train]\nsteps = 1\n")
