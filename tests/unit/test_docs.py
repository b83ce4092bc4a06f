"""The README and docs/ as a reader meets them: a short README that links every page, links that lead somewhere,
and fenced blocks that say what they hold (issue #20, #22). The snippets themselves run in
tests/integration/test_docs_snippets.py."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
MAX_README_LINES = 200
LANGUAGES = ("sh", "python", "properties", "json", "text")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)(?P<info>.*)$")
HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+).+?\1")
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


def _fences(page: Path) -> list[tuple[int, str, str]]:
    """Each fenced block's opening line: (line number, indentation, info string)."""
    found, open_fence = [], ""
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        match = FENCE.match(line)
        if match is None:
            continue
        if not open_fence:
            open_fence = match["fence"]
            found.append((number, match["indent"], match["info"].strip()))
        elif match["fence"].startswith(open_fence) and not match["info"].strip():
            open_fence = ""
    assert not open_fence, f"{_name(page)}: a fenced block is never closed"
    return found


def _prose(page: Path) -> list[str]:
    """The page's lines outside fenced blocks."""
    lines, open_fence = [], ""
    for line in page.read_text().splitlines():
        match = FENCE.match(line)
        if match is not None and not open_fence:
            open_fence = match["fence"]
        elif match is not None and match["fence"].startswith(open_fence) and not match["info"].strip():
            open_fence = ""
        elif not open_fence:
            lines.append(line)
    return lines


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2 ... for repeated titles."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose(page):
        match = HEADING.match(line)
        if match is None:
            continue
        base = slug(match["title"])
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    """The targets of the page's Markdown links, outside code."""
    targets = []
    for line in _prose(page):
        targets += [match["target"] for match in LINK.finditer(INLINE_CODE.sub("", line))]
    return targets


def test_the_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_slugs_follow_githubs_rules() -> None:
    assert slug("Where it runs, truthfully") == "where-it-runs-truthfully"
    assert slug("`transform_fn`") == "transform_fn"
    assert slug("PyTorch 2 artifacts") == "pytorch-2-artifacts"
    assert slug("requirements.txt") == "requirementstxt"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_leads_to_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in links(page):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / unquote(path)).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and unquote(anchor) not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {linked.name}")
    assert broken == [], f"{_name(page)}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in links(README)}
    missing = [_name(page) for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert missing == [], f"link these from the README's table of contents: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_fenced_block_names_its_language(page: Path) -> None:
    fences = _fences(page)
    unnamed = [f"line {number}: {info or 'no language'}" for number, _, info in fences if info not in LANGUAGES]
    assert unnamed == [], f"{_name(page)}: fenced blocks need one of {', '.join(LANGUAGES)}: {unnamed}"
    # The snippet tests find blocks by a fence at the start of a line: an indented one would go unrun.
    indented = [f"line {number}" for number, indent, _ in fences if indent]
    assert indented == [], f"{_name(page)}: start fences at the beginning of the line: {indented}"
