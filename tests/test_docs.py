"""The documentation's shape: a README that stays short and says the limits plainly, and links that lead somewhere.

``mkdocs build --strict`` (in ``.ci/run``) checks the site: every page in the navigation, every link and anchor between
pages. These tests check what the site does not see: the README and the changelog, which live outside ``docs/``, read
as GitHub renders them."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def _outside_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchors(path: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub and Python-Markdown both make them for this project's headings."""
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _outside_fences(path.read_text()), flags=re.M):
        plain = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
        plain = re.sub(r"[^\w\s-]", "", plain).strip().lower()
        anchors.add(re.sub(r"[-\s]+", "-", plain))
    return anchors


def _broken_links(page: Path) -> list[str]:
    text = _outside_fences(page.read_text())
    broken = []
    for target in LINK.findall(text) + IMAGE.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: {linked.name} has no heading with that anchor")
    return broken


@pytest.mark.parametrize("name", ["README.md", "CHANGELOG.md"])
def test_every_link_of_the_readme_and_the_changelog_leads_to_a_file_and_heading_that_exist(name):
    assert _broken_links(PROJECT / name) == []


def test_the_anchor_check_finds_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\n## The part\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#the-part) [gone](a.md#the-whole) [none](c.md) ![img](a.png)\n```\n[x](d.md)\n```\n")
    assert _broken_links(page) == [
        "a.md#the-whole: a.md has no heading with that anchor",
        "c.md: no such file",
        "a.png: no such file",
    ]


def test_the_readme_keeps_to_the_pitch_the_quickstart_use_and_configuration():
    readme = (PROJECT / "README.md").read_text()
    assert len(readme.splitlines()) < 400, "the reference belongs in docs/"
    headings = re.findall(r"^## (.+)$", _outside_fences(readme), flags=re.M)
    assert headings[:3] == ["Quickstart", "Using it from the Dagster UI", "Use it as a library"]
    assert {"What is guaranteed, and what is not", "Configuration", "The operator CLI"} <= set(headings)


def test_the_readme_states_the_three_limits_plainly():
    readme = " ".join((PROJECT / "README.md").read_text().split())
    for limit in (
        "A lock file does not give exactly-once",
        "A database transaction cannot commit a remote upload",
        "An unknown remote outcome is not safe to retry** unless the destination deduplicates",
    ):
        assert limit in readme


def test_every_docs_page_is_in_the_site_navigation():
    nav = (PROJECT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    listed = set(re.findall(r":\s*([\w-]+\.md)\s*$", nav, flags=re.M))
    assert listed == {page.name for page in (PROJECT / "docs").glob("*.md")}


WALK_STEP = re.compile(r"`(export_ledger/[\w/]+\.py):(\d+)`\s+`(\w+)`")  # a step may wrap between its path and name


def test_every_step_of_the_walk_names_the_line_its_function_is_defined_on():
    """docs/walk.md names each function of one export with its file and line: an edit that moves one makes this fail,
    naming the step, so that the page is mended with the code. A line that holds an abstract declaration is refused
    too: the walk goes through what runs, not the contract that declares it."""
    steps = WALK_STEP.findall((PROJECT / "docs" / "walk.md").read_text())
    assert len(steps) >= 20, "the walk names each function it goes through"
    wrong = []
    for path, line, name in steps:
        source = (PROJECT / path).read_text().splitlines()
        named = source[int(line) - 1] if 0 < int(line) <= len(source) else ""
        if not re.match(rf"\s*def {name}\(", named):
            defined = [n for n, text in enumerate(source, 1) if re.match(rf"\s*def {name}\(", text)]
            wrong.append(f"{path}:{line} {name} (defined on line(s) {defined})")
        elif "abstractmethod" in _decorators(source, int(line)):
            wrong.append(f"{path}:{line} {name} (an abstract declaration: name the method that implements it)")
    assert wrong == [], "each step names the line its function is defined on, and that function runs"


def _decorators(source: list[str], line: int) -> str:
    """The decorator lines just above line ``line`` (1-based) of ``source``."""
    found = []
    while line > 1 and source[line - 2].strip().startswith("@"):
        line -= 1
        found.append(source[line - 1].strip())
    return " ".join(found)
