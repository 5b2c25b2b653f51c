"""README.md is the door and docs/ the rooms: the README stays short, links into every page, and every link and
repository path the pages name exists inside the repository (the commands they show are checked by
tests/system/test_documented_commands.py)."""

import os
import re

import pytest
from doc_commands import ROOT, markdown_files

PAGES = markdown_files()
README_MAX_LINES = 150
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATH_SPAN = re.compile(r"`((?:jaxpar|configs|tests|examples|benchmarks|tools|docs|\.ci)/[\w./-]*)`")


def _text(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def _anchors(page: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than `-` and `_` dropped, spaces to `-`."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", _text(page), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_is_short_and_links_every_page():
    assert len(_text("README.md").splitlines()) <= README_MAX_LINES
    linked = {os.path.normpath(t.split("#")[0]) for t in _LINK.findall(_text("README.md"))}
    assert {p for p in PAGES if p.startswith("docs/")} <= linked, "a docs page the README does not link"


@pytest.mark.parametrize("page", PAGES)
def test_links_and_paths_exist_inside_the_repository(page):
    here = os.path.dirname(os.path.join(ROOT, page))
    for target in _LINK.findall(_text(page)):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(here, path)) if path else os.path.join(ROOT, page)
        assert full.startswith(ROOT + os.sep) and os.path.exists(full), f"{page}: link {target} leads nowhere"
        if anchor:
            assert anchor in _anchors(os.path.relpath(full, ROOT)), f"{page}: no heading for #{anchor} in {path}"
    for path in _PATH_SPAN.findall(_text(page)):
        if not re.search(r"[*<>]|[A-Z]{2,}", path):  # a glob or a placeholder (RUN_DIR/...) names no one file
            assert os.path.exists(os.path.join(ROOT, path.rstrip("/"))), f"{page}: {path} does not exist"
