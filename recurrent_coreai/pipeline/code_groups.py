"""The code each DVC stage runs, as one small file per code set: ``results/code/<group>.md5``.

A stage's code is the files of :func:`fingerprint.code_files` (its script, its module and every
module that imports, its family's folder, its tokenizer kind). Listed one by one as the deps of
every stage, that was ~40 entries a stage and 5116 of dvc.lock's 5610 deps: an 880 KB dvc.lock,
which DVC parses and writes again, in its pure-Python round trip, after every stage `dvc repro`
runs (~5 s a stage on this project's host: docs/measurements/2026-12-06-dvc-lock.md).

So dvc.yaml has one stage more, ``code``: its deps are every code file any stage runs, its outs
one file per code set (a *group*: the rule, the family where the rule runs family code, the
tokenizer kind where it loads one -- exactly what :func:`fingerprint.code_files` depends on), each
holding ``md5sum``'s lines for that set's files (``md5sum -c`` checks one). Every other stage
depends on its group's file instead of the files themselves. Editing a file reruns ``code``;
the group files whose lines change then rerun exactly the stages that run that file, as before,
and a group file whose lines stay the same reruns nothing.

Snakemake does not see these files: its rules hash the same code through ``params: code``
(rules/common.smk). ``scripts/dvc_record.py`` writes them after a Snakemake run (:func:`write`)
and records the ``code`` stage beside the stages the run built; ``dvc repro`` runs the stage's
command, ``python scripts/code_groups.py --out results/code GROUP ...``. The stage's own deps also
hold its own code (:func:`own_files`), so a change to how the files are written reruns it.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from recurrent_coreai.util.errors import main_guard
from recurrent_coreai.pipeline.fingerprint import FAMILY_RULES, ROOT, TOKENIZER_RULES, code_files, module_closure, module_file

SCRIPT = "scripts/code_groups.py"

STAGE = "code"  # the dvc.yaml stage that writes the group files
FOLDER = "code"  # below the results directory
SUFFIX = ".md5"
SEP = "."  # rule, family and tokenizer kind in a group's name (a kind's name may hold '-')


def group(rule: str, family: str | None = None, tokenizer: str | None = None) -> str:
    """The code set of a stage of ``rule`` for a model of ``family`` with tokenizer kind
    ``tokenizer`` (default the family's), named by what :func:`fingerprint.code_files` uses of them."""
    parts = [rule]
    if family is not None and rule in FAMILY_RULES:
        parts.append(family)
    if family is not None and rule in TOKENIZER_RULES:
        from recurrent_coreai import families

        parts.append(tokenizer or families.get(family).tokenizer)
    return SEP.join(parts)


def parse(name: str) -> tuple[str, str | None, str | None]:
    """(rule, family, tokenizer kind) of a :func:`group` name."""
    parts = name.split(SEP)
    if not 1 <= len(parts) <= 3 or not all(parts):
        raise ValueError(f"{name!r} is not a code group name (rule[.family[.tokenizer kind]])")
    return parts[0], parts[1] if len(parts) > 1 else None, parts[2] if len(parts) > 2 else None


def files(name: str) -> list[str]:
    """The repository-relative code files of group ``name``."""
    return code_files(*parse(name))


def own_files() -> list[str]:
    """The code of the ``code`` stage itself: its script and this module with what it imports."""
    return sorted({SCRIPT, *map(module_file, module_closure("pipeline.code_groups"))})


def path(results: str, name: str) -> str:
    """The group file of ``name`` as dvc.yaml names it (``results`` as config.yaml names it)."""
    return f"{results.rstrip('/')}/{FOLDER}/{name}{SUFFIX}"


def text(name: str, root: Path = ROOT) -> str:
    """The group file's content: ``md5sum``'s line for each of its files, sorted by path."""
    return "".join(f"{hashlib.md5((root / rel).read_bytes()).hexdigest()}  {rel}\n" for rel in files(name))


def recorded_md5s(data: str) -> dict[str, str]:
    """``{file: md5}`` of a group file's content (what :func:`text` wrote)."""
    out = {}
    for line in data.splitlines():
        md5, sep, rel = line.partition("  ")
        if not sep or len(md5) != 32:
            raise ValueError(f"{line!r} is not an md5sum line")
        out[rel] = md5
    return out


def write(out_dir: Path, names: list[str], root: Path = ROOT) -> bool:
    """Every group file of ``names`` in ``out_dir`` as :func:`text` makes it. When one is missing
    or differs, all are written again (so each is newer than a run's start: the whole stage was
    made, scripts/dvc_record.py) and anything else in ``out_dir`` is removed; whether it wrote."""
    from recurrent_coreai.util.fsutil import write_text_atomic

    out_dir = Path(out_dir)
    want = {f"{name}{SUFFIX}": text(name, root) for name in names}
    have = {p.name for p in out_dir.glob("*")} if out_dir.is_dir() else set()
    if have == set(want) and all((out_dir / f).read_text(encoding="utf-8") == t for f, t in want.items()):
        return False
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in have - set(want):
        (out_dir / stale).unlink()
    for f, t in want.items():
        write_text_atomic(out_dir / f, t)
    return True


def stale(out_dir: Path, names: list[str], root: Path = ROOT) -> list[str]:
    """The group files of ``names`` in ``out_dir`` that are missing or not what :func:`text` makes."""
    bad = []
    for name in names:
        p = Path(out_dir) / f"{name}{SUFFIX}"
        if not p.is_file() or p.read_text(encoding="utf-8") != text(name, root):
            bad.append(name)
    return bad


@main_guard
def main(argv: list[str] | None = None) -> int:
    """The ``code`` stage's command. Like every stage it validates the whole config first: as the
    first stage `dvc repro` runs, it is the one a bad config.yaml stops, in one line, before
    anything is written."""
    from recurrent_coreai.pipeline import config as cfgmod

    ap = argparse.ArgumentParser(prog="scripts/code_groups.py",
                                 description="write the code group files of dvc.yaml's `code` stage")
    ap.add_argument("--config-file", default=cfgmod.DEFAULT_FILE)
    ap.add_argument("--out", type=Path, required=True, help="the folder (results/code)")
    ap.add_argument("groups", nargs="+", help="group names: rule[.family[.tokenizer kind]]")
    ns = ap.parse_args(argv)
    cfgmod.load(ns.config_file)
    for name in ns.groups:
        parse(name)
    write(ns.out, ns.groups)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
