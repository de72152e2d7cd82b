"""A model card's YAML front matter (the ``---`` block at the top of README.md)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from recurrent_coreai.util.errors import PipelineError

FRONT = re.compile(r"\A---\n.*?\n---\n", re.S)


def front_matter(readme: Path) -> dict:
    """The YAML front matter of a model card (``{}`` without one). Invalid YAML is a PipelineError
    naming the line, so that a bad source card fails in the source stage, not in the card stage."""
    fix = "fix the YAML between the --- lines at the top of README.md"
    try:
        text = readme.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PipelineError(readme, f"is not UTF-8 (byte {exc.start})", "save README.md as UTF-8") from None
    m = FRONT.match(text)
    if not m:
        return {}
    body = m.group(0)[4:-4]  # between the --- lines: its line 1 is line 2 of the file
    try:
        meta = yaml.safe_load(body)
    except yaml.YAMLError as exc:
        mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None) or str(exc).splitlines()[0]
        start = getattr(exc, "context_mark", None)
        if start is not None and (mark is None or mark.line >= body.count("\n")):
            mark, problem = start, f"{exc.context}: {problem}"  # ran off the end: say where it began
        line = 2 + (mark.line if mark is not None else 0)
        raise PipelineError(readme, f"YAML front matter is invalid at line {line} ({problem}): "
                            f"{text.splitlines()[line - 1][:80]!r}", fix) from None
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise PipelineError(readme, f"YAML front matter is a {type(meta).__name__}, not a mapping of keys", fix)
    return meta
