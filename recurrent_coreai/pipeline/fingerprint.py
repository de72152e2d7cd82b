"""The code each stage runs, as files: its entry script, its module and every package module that
module imports (transitively, also imports inside functions), plus the data files those read.

Snakemake sees a stage's code through ``params: code=digest(rule)`` (content, not mtimes) and DVC
through the same files as ``deps`` in the generated dvc.yaml: editing the card template reruns
the card (and what depends on it), editing the reference stage reruns the reference (and the
publish stage, below) — and nothing else does.

Families are imported by name at run time (``families.get(name)``), which no ``import`` statement
shows: a stage that runs a family's code (:data:`FAMILY_RULES`) gets that family's folder in its
fingerprint through :func:`digest` with ``family=``; a stage that loads the model's tokenizer kind
(:data:`TOKENIZER_RULES`; also loaded by name: ``tokenizers.kind``) gets that kind's module,
``tokenizer=`` (the model's ``families.tokenizer_of``; default the family's). So editing
``families/rwkv7/`` reruns the RWKV-7 models' stages that use family code and nothing of another
family's models, and editing ``tokenizers/bytes.py`` the stages of the byte-level models that use
their tokenizer.

The publish stage attests the code that built each bundle (hub/provenance.py records
:func:`attested`: a digest per rule), so its own fingerprint covers all of that code: editing any
of it restages, and a statement never names code that did not build it.
``python -m recurrent_coreai.pipeline.fingerprint RULE [--family F] [--files]`` prints a rule's
digest (and its files): how a verifier checks a statement's code digests against a checkout.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

from recurrent_coreai.pipeline import warm

PACKAGE = Path(__file__).resolve().parents[1]
ROOT = PACKAGE.parent
NAME = PACKAGE.name
# rule -> (entry script, module holding its ``main``, dotted below the package)
ENTRY = {
    "toolchain": ("toolchain", "stages.toolchain"), "source": ("source", "stages.source"),
    "vocab": ("vocab", "stages.vocab"), "reference": ("reference", "stages.reference"),
    "export": ("export", "stages.export"), "aot": ("aot", "stages.aot"), "gate": ("gate", "stages.gate"),
    "gate_shard": ("gate_shard", "stages.gate_shard"),
    "card": ("card", "stages.card"), "stage_and_push": ("publish", "stages.publish"),
    "doctor": ("doctor", "stages.doctor"), "report": ("report", "stages.report"),
}
# data files a module reads at run time (globs relative to the module's folder)
DATA = {"stages.card": ("templates/model_card.md.j2",), "stages.report": ("templates/report.html.j2",),
        "pipeline.config": ("schemas/*.yaml",)}
# rules whose stage runs a family's code (loaded by name through the registry)
FAMILY_RULES = frozenset({"source", "vocab", "reference", "export", "doctor", "card", "stage_and_push"})
# rules whose stage loads the model's tokenizer kind (by name: tokenizers.kind); export and doctor do not
TOKENIZER_RULES = frozenset({"source", "vocab", "reference", "card", "stage_and_push"})
# the rules whose code built what the publish stage stages and attests (hub/provenance.py)
ATTESTED = ("toolchain", "source", "vocab", "reference", "export", "aot", "gate_shard", "gate", "doctor", "card")


def _path(module: str) -> Path | None:
    """The file of a dotted module below the package (a module file or a package's __init__)."""
    base = PACKAGE.joinpath(*module.split(".")) if module else PACKAGE
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _resolve(module: str, node: ast.ImportFrom) -> list[str]:
    """Package modules one ``from … import …`` names (relative or absolute)."""
    if node.level:
        parts = module.split(".")
        is_pkg = _path(module) is not None and _path(module).name == "__init__.py"
        base_parts = parts if is_pkg else parts[:-1]
        base_parts = base_parts[: len(base_parts) - (node.level - 1)] if node.level > 1 else base_parts
        base = ".".join(p for p in base_parts + ((node.module or "").split(".") if node.module else []) if p)
    elif (node.module or "") == NAME or (node.module or "").startswith(NAME + "."):
        base = (node.module or "").removeprefix(NAME).lstrip(".")
    else:
        return []
    found = [base] if _path(base) is not None and base else []
    for alias in node.names:  # `from pkg import module`
        sub = f"{base}.{alias.name}" if base else alias.name
        if _path(sub) is not None:
            found.append(sub)
    return found


@functools.lru_cache(maxsize=None)
def _imports(module: str) -> frozenset[str]:
    """Package modules ``module`` imports anywhere in its body (and the packages above them)."""
    path = _path(module)
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = _resolve(module, node)
        elif isinstance(node, ast.Import):
            names = [a.name.removeprefix(NAME + ".") for a in node.names if a.name.startswith(NAME + ".")]
        else:
            continue
        for n in names:
            parts = n.split(".")
            found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1) if _path(".".join(parts[:i]))}
    return frozenset(found)


@functools.lru_cache(maxsize=None)
def module_closure(start: str) -> tuple[str, ...]:
    """``start`` and every package module it imports, transitively (the package's ``__init__``
    always: importing the package runs it)."""
    todo, seen = [start, ""], set()
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(_imports(m) - seen)
    return tuple(sorted(seen))


def modules(rule: str) -> tuple[str, ...]:
    """The package modules a rule's stage runs (without a family's own modules)."""
    return module_closure(ENTRY[rule][1])


def tokenizer_module(family: str, tokenizer: str | None = None) -> str:
    """The module of tokenizer kind ``tokenizer`` (a model's: ``families.tokenizer_of``; None: the
    family's default): loaded by name too (``tokenizers.kind``)."""
    from recurrent_coreai import families, tokenizers

    return f"tokenizers.{tokenizers.KINDS[tokenizer or families.get(family).tokenizer]}"


def family_modules(family: str) -> tuple[str, ...]:
    """Every module of ``families/<family>/`` and what they import (the shared layers)."""
    folder = PACKAGE / "families" / family
    start = sorted(f"families.{family}." + p.relative_to(folder).with_suffix("").as_posix().replace("/", ".")
                   for p in folder.rglob("*.py") if p.name != "__init__.py")
    found: set[str] = set()
    for m in [f"families.{family}", *start]:
        found |= set(module_closure(m))
    return tuple(sorted(found))


def module_file(module: str) -> str:
    """The repository-relative file of a dotted module below the package."""
    return _path(module).relative_to(ROOT).as_posix()


def code_files(rule: str, family: str | None = None, tokenizer: str | None = None) -> list[str]:
    """Repository-relative paths of everything the rule's stage runs; with ``family``, also that
    family's folder (for the rules of :data:`FAMILY_RULES`) and the model's tokenizer kind's module
    (``tokenizer``, default the family's; for the rules of :data:`TOKENIZER_RULES`). The publish
    stage's include the code of every rule it attests (:data:`ATTESTED`)."""
    files = {f"scripts/{ENTRY[rule][0]}.py"}
    if rule == "stage_and_push":
        files |= {f for other in ATTESTED for f in code_files(other, family, tokenizer)}
    mods = set(modules(rule))
    if f"{NAME}.{ENTRY[rule][1]}" in warm.SERVED:  # its script runs it through the run's warm process
        mods |= set(module_closure(warm.__name__.removeprefix(NAME + ".")))
    if family is not None and rule in TOKENIZER_RULES:
        mods |= set(module_closure(tokenizer_module(family, tokenizer)))
    if family is not None and rule in FAMILY_RULES:
        mods |= set(family_modules(family))
        folder = PACKAGE / "families" / family
        files |= {p.relative_to(ROOT).as_posix() for p in folder.rglob("*") if p.is_file()
                  and "__pycache__" not in p.parts}
    for m in mods:
        files.add(module_file(m))
        folder = _path(m).parent
        for pattern in DATA.get(m, ()):
            files |= {p.relative_to(ROOT).as_posix() for p in folder.glob(pattern)}
    return sorted(files)


def digest(rule: str, family: str | None = None, tokenizer: str | None = None) -> str:
    """sha256 over the contents of :func:`code_files` (what Snakemake's params hold)."""
    h = hashlib.sha256()
    for rel in code_files(rule, family, tokenizer):
        h.update(rel.encode() + b"\0" + (ROOT / rel).read_bytes() + b"\0")
    return h.hexdigest()


def attested(family: str, tokenizer: str | None = None) -> dict[str, str]:
    """{rule: :func:`digest`} of the code that built and staged a model of ``family`` with tokenizer
    kind ``tokenizer`` (default the family's): what each bundle's provenance statement attests
    (hub/provenance.py)."""
    return {rule: digest(rule, family, tokenizer) for rule in (*ATTESTED, "stage_and_push")}


def main(argv: list[str] | None = None) -> int:
    """Print a rule's code digest (``--files``: and the files it covers)."""
    import argparse

    from recurrent_coreai.tokenizers import KINDS

    ap = argparse.ArgumentParser(prog="python -m recurrent_coreai.pipeline.fingerprint",
                                 description="the code digest of a stage, as provenance statements record it")
    ap.add_argument("rule", choices=sorted(ENTRY))
    ap.add_argument("--family", help="the model's family (for the rules that run family code)")
    ap.add_argument("--tokenizer", choices=sorted(KINDS), help="the model's tokenizer kind, where it names one (models.<m>.tokenizer; "
                    "default the family's)")
    ap.add_argument("--files", action="store_true", help="list the files the digest covers")
    ns = ap.parse_args(argv)
    print(digest(ns.rule, ns.family, ns.tokenizer))
    if ns.files:
        print("\n".join(code_files(ns.rule, ns.family, ns.tokenizer)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
