"""The code each stage runs, as files: its entry script, its module and every package module that
module imports (transitively, also imports inside functions), plus the data files those read.

Snakemake sees a stage's code through ``params: code=digest(rule)`` (content, not mtimes) and DVC
through the same files as ``deps`` in the generated dvc.yaml: editing the card template reruns
the card (and what depends on it), editing ``reference.py`` reruns the reference — and nothing
else does.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
ROOT = PACKAGE.parent
# rule -> (entry script, module holding its ``main``)
ENTRY = {
    "toolchain": ("toolchain", "toolchain"), "source": ("source", "source"), "vocab": ("vocab", "vocab"),
    "reference": ("reference", "reference_stream"), "export": ("export", "export"), "aot": ("aot", "aot"),
    "gate": ("gate", "gate"), "card": ("card", "card"), "stage_and_push": ("publish", "publish"),
    "doctor": ("doctor", "doctor"), "report": ("report", "report"),
}
# data files a module reads at run time (package-relative globs)
DATA = {"card": ("templates/model_card.md.j2",), "report": ("templates/report.html.j2",), "config": ("schemas/*.yaml",)}


@functools.lru_cache(maxsize=None)
def _imports(module: str) -> frozenset[str]:
    """Package modules ``module`` imports anywhere in its body."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text(), filename=f"{module}.py")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level == 1 or (node.module or "").startswith(PACKAGE.name)):
            base = (node.module or "").removeprefix(PACKAGE.name).lstrip(".")
            names = [base.split(".")[0]] if base else [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names if a.name.startswith(PACKAGE.name + ".")]
        else:
            continue
        found |= {n for n in names if (PACKAGE / f"{n}.py").is_file()}
    return frozenset(found)


@functools.lru_cache(maxsize=None)
def modules(rule: str) -> tuple[str, ...]:
    """The package modules a rule's stage runs (``__init__`` always: importing the package runs it)."""
    todo, seen = [ENTRY[rule][1], "__init__"], set()
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(_imports(m) - seen)
    return tuple(sorted(seen))


def code_files(rule: str) -> list[str]:
    """Repository-relative paths of everything the rule's stage runs."""
    files = [f"scripts/{ENTRY[rule][0]}.py"]
    for m in modules(rule):
        files.append(f"{PACKAGE.name}/{m}.py")
        for pattern in DATA.get(m, ()):
            files += sorted(p.relative_to(ROOT).as_posix() for p in PACKAGE.glob(pattern))
    return sorted(files)


def digest(rule: str) -> str:
    """sha256 over the contents of :func:`code_files` (what Snakemake's params hold)."""
    h = hashlib.sha256()
    for rel in code_files(rule):
        h.update(rel.encode() + b"\0" + (ROOT / rel).read_bytes() + b"\0")
    return h.hexdigest()
