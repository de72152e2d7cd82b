"""The documentation holds together: every relative link in README.md and docs/**/*.md resolves
(a file that exists; for ``#anchor`` links into markdown, a heading with that GitHub slug), every
file under docs/ is reachable by links from README.md (no orphan page), and the pages stay short
(README.md at most 300 lines, each docs/*.md outside docs/measurements/ at most 350).

The checker is plain functions over a tree, so it is tested on temporary trees too: a broken link,
a missing anchor and an orphan must each be reported.
"""

from __future__ import annotations

import re
import unicodedata
from collections import deque
from pathlib import Path
from urllib.parse import unquote

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
DOC_MAX_LINES = 350
UNLIMITED = ("measurements",)  # docs/<these>/ hold logs kept verbatim: no line limit

_MD = MarkdownIt("commonmark").enable("table")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # http:, https:, mailto:, ...


def github_slug(text: str) -> str:
    """The anchor GitHub gives a heading: lower case; punctuation and symbols removed (letters,
    digits, marks, '-', '_' and spaces kept); each space becomes '-'."""
    kept = []
    for ch in text.lower():
        if ch in "-_ " or unicodedata.category(ch)[0] in "LNM":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def _inline_text(token) -> str:
    return "".join(c.content for c in (token.children or []) if c.type in ("text", "code_inline"))


def parse(path: Path) -> tuple[list[str], set[str]]:
    """The link targets (href of links, src of images) outside code, and the heading anchors."""
    tokens = _MD.parse(path.read_text(encoding="utf-8"))
    links: list[str] = []
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if tok.type == "heading_open":
            slug = github_slug(_inline_text(tokens[i + 1]))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
        if tok.type == "inline":
            for child in tok.children or []:
                if child.type == "link_open":
                    links.append(str(child.attrs.get("href", "")))
                elif child.type == "image":
                    links.append(str(child.attrs.get("src", "")))
    return links, anchors


def _resolve(root: Path, page: Path, target: str) -> tuple[Path, str]:
    """(file, anchor) a relative link on ``page`` points at; '/x' is relative to the repo root."""
    path, _, anchor = target.partition("#")
    path = unquote(path)
    if not path:
        return page, anchor
    base = root if path.startswith("/") else page.parent
    return (base / path.lstrip("/")).resolve(), anchor


def pages(root: Path) -> list[Path]:
    """README.md and every markdown file under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def check_links(root: Path) -> list[str]:
    """One line per broken relative link: '<page>: link <target>: <what is wrong>'."""
    root = root.resolve()
    problems: list[str] = []
    cache: dict[Path, tuple[list[str], set[str]]] = {}

    def parsed(p: Path):
        if p not in cache:
            cache[p] = parse(p)
        return cache[p]

    for page in pages(root):
        page = page.resolve()
        if not page.is_file():
            problems.append(f"{page.relative_to(root)}: is missing")
            continue
        for target in parsed(page)[0]:
            if not target or _SCHEME.match(target):
                continue
            dest, anchor = _resolve(root, page, target)
            where = f"{page.relative_to(root)}: link {target}"
            if not dest.exists():
                problems.append(f"{where}: {dest} does not exist")
            elif anchor and dest.suffix == ".md":
                if anchor not in parsed(dest)[1]:
                    problems.append(f"{where}: {dest.name} has no heading with the anchor #{anchor}")
    return problems


def orphans(root: Path) -> list[str]:
    """Files under docs/ that no chain of relative links from README.md reaches."""
    root = root.resolve()
    start = root / "README.md"
    reached = {start}
    todo = deque([start])
    while todo:
        page = todo.popleft()
        if page.suffix != ".md" or not page.is_file():
            continue
        for target in parse(page)[0]:
            if not target or _SCHEME.match(target):
                continue
            dest, _ = _resolve(root, page, target)
            if dest.is_file() and dest not in reached:
                reached.add(dest)
                todo.append(dest)
    docs = root / "docs"
    files = sorted(p.resolve() for p in docs.rglob("*") if p.is_file()) if docs.is_dir() else []
    return [str(p.relative_to(root)) for p in files if p not in reached]


def too_long(root: Path, readme_max: int = README_MAX_LINES, doc_max: int = DOC_MAX_LINES) -> list[str]:
    """Pages over their line limit: '<page>: N lines, limit M'."""
    root = root.resolve()
    out = []
    n = len((root / "README.md").read_text(encoding="utf-8").splitlines())
    if n > readme_max:
        out.append(f"README.md: {n} lines, limit {readme_max}")
    for page in sorted((root / "docs").rglob("*.md")):
        rel = page.relative_to(root / "docs")
        if rel.parts[0] in UNLIMITED:
            continue
        n = len(page.read_text(encoding="utf-8").splitlines())
        if n > doc_max:
            out.append(f"docs/{rel}: {n} lines, limit {doc_max}")
    return out


# --- the repository's own documentation -------------------------------------------------------

def test_every_relative_link_resolves():
    problems = check_links(ROOT)
    assert not problems, "broken links -- fix the link or the heading:\n" + "\n".join(problems)


def test_every_docs_file_is_reachable_from_the_readme():
    lost = orphans(ROOT)
    assert not lost, ("not linked from README.md or a page it reaches -- fix: link them from the page "
                      "on their topic:\n" + "\n".join(lost))


def test_pages_stay_short():
    long = too_long(ROOT)
    assert not long, "split or shorten (measurement logs go to docs/measurements/):\n" + "\n".join(long)


# --- the checker itself ------------------------------------------------------------------------

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return tmp_path


GOOD = {
    "README.md": "# Title\n\nSee [a](docs/a.md#second-part), [top](#title) and [cfg](config.yaml).\n",
    "docs/a.md": "# A\n\n## Second part\n\n[log](measurements/2026-01-01-x.md) and [back](../README.md#title).\n",
    "docs/measurements/2026-01-01-x.md": "# Log\n\n" + "line\n" * 400,
    "config.yaml": "x: 1\n",
}


def test_checker_passes_a_consistent_tree(tmp_path):
    root = _tree(tmp_path, GOOD)
    assert check_links(root) == []
    assert orphans(root) == []
    assert too_long(root) == []  # the 400-line log is under measurements/: no limit


def test_checker_reports_a_broken_link_a_missing_anchor_and_an_orphan(tmp_path):
    root = _tree(tmp_path, {
        **GOOD,
        "README.md": GOOD["README.md"] + "\n[gone](docs/nope.md) and [bad anchor](docs/a.md#third-part).\n",
        "docs/orphan.md": "# Nobody links here\n\n[up](../README.md)\n",
    })
    problems = check_links(root)
    assert len(problems) == 2, problems
    assert problems[0].startswith("README.md: link docs/nope.md:") and "does not exist" in problems[0]
    assert problems[1] == "README.md: link docs/a.md#third-part: a.md has no heading with the anchor #third-part"
    assert orphans(root) == ["docs/orphan.md"]


def test_checker_reports_a_link_reached_only_through_an_orphan(tmp_path):
    # docs/b.md is linked, but only from an orphan: both are unreachable from README.md
    root = _tree(tmp_path, {**GOOD, "docs/orphan.md": "[b](b.md)\n", "docs/b.md": "# B\n"})
    assert orphans(root) == ["docs/b.md", "docs/orphan.md"]


def test_checker_ignores_code_and_external_links_and_checks_line_limits(tmp_path):
    root = _tree(tmp_path, {
        **GOOD,
        "docs/a.md": GOOD["docs/a.md"] + "\n```\n[not a link](nope.md)\n```\n`[nor](this.md)`\n"
                     "[web](https://example.com/x.md) [mail](mailto:a@b.c)\n" + "x\n" * 360,
    })
    assert check_links(root) == []
    assert too_long(root) == [f"docs/a.md: {len((root / 'docs/a.md').read_text().splitlines())} lines, limit 350"]
    assert too_long(root, readme_max=2) == ["README.md: 3 lines, limit 2", too_long(root)[0]]


@pytest.mark.parametrize("heading, slug", [
    ("Configuration (`config.yaml`)", "configuration-configyaml"),
    ("`make test-cluster`", "make-test-cluster"),
    ("Rebuilds: what reruns, and byte-identical bundles", "rebuilds-what-reruns-and-byte-identical-bundles"),
    ("fp16 accuracy at 1.5B: the Linux runtime", "fp16-accuracy-at-15b-the-linux-runtime"),
    ("Talk to a bundle: `generate`", "talk-to-a-bundle-generate"),
    ("A — B → C", "a--b--c"),
    ("snake_case and Ünïcode", "snake_case-and-ünïcode"),
])
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


def test_repeated_headings_get_numbered_anchors(tmp_path):
    p = tmp_path / "x.md"
    p.write_text("# Notes\n\n## Notes\n\n## Notes\n", encoding="utf-8")
    assert parse(p)[1] == {"notes", "notes-1", "notes-2"}
