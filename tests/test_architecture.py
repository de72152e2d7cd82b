"""The package's layers and seams, as tests (docs/architecture.md).

* import-linter's contracts (pyproject.toml ``[tool.importlinter]``) hold, and breaking one on
  purpose -- a stage importing a family module -- fails them;
* the family contracts cover every registered family (``families.NAMES``) by a wildcard, with no
  line per family: a new family folder is under them as soon as it exists;
* nothing RWKV-7-specific is written outside ``families/rwkv7/`` and the World tokenizer: the state
  names, the x070 name, the World vocab file, the WKV, RWKV-7 tensor names;
* old environment variable names still work, with a deprecation note.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "recurrent_coreai"
LINT = Path(sys.executable).with_name("lint-imports")
# folders that must not know an architecture (families/ and tokenizers/ may)
NEUTRAL = ("stages", "pipeline", "hub", "tools", "coreai", "checkpoints", "util")
RWKV7_LITERALS = re.compile(r"recState|shiftState|x070|rwkv_vocab|\bwkv|\bWKV|attn\.x_[rwkvag]\b|attn\.x_x|"
                            r"ffn\.(key|value)\b|\b[rkvo]_proj\b|[wavg]_lora|g_norm|\bk_k\b|\br_k\b|v_first")


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root,
                          capture_output=True, text=True, env={"PATH": str(LINT.parent), "PYTHONPATH": str(root)},
                          timeout=300)


def test_the_import_contracts_hold():
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "3 kept, 0 broken" in proc.stdout


def test_a_stage_importing_a_family_module_breaks_the_contracts(tmp_path):
    copy = tmp_path / "tree"
    copy.mkdir()
    shutil.copy(ROOT / "pyproject.toml", copy)
    shutil.copytree(PACKAGE, copy / PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__"))
    gate = copy / PACKAGE.name / "stages" / "gate.py"
    gate.write_text(gate.read_text() + "\nfrom recurrent_coreai.families.rwkv7 import geometry  # noqa: E402,F401\n")
    proc = lint(copy)
    assert proc.returncode != 0
    assert "BROKEN" in proc.stdout
    assert "recurrent_coreai.stages.gate -> recurrent_coreai.families.rwkv7" in proc.stdout.replace("\n", " ") or \
        "recurrent_coreai.stages.gate" in proc.stdout


def test_a_family_importing_a_stage_breaks_the_layers(tmp_path):
    copy = tmp_path / "tree"
    copy.mkdir()
    shutil.copy(ROOT / "pyproject.toml", copy)
    shutil.copytree(PACKAGE, copy / PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__"))
    ref = copy / PACKAGE.name / "families" / "rwkv7" / "reference.py"
    ref.write_text(ref.read_text() + "\nfrom recurrent_coreai.stages import gate  # noqa: E402,F401\n")
    proc = lint(copy)
    assert proc.returncode != 0 and "layers: a folder imports only the folders below it BROKEN" in proc.stdout


def contracts() -> dict[str, dict]:
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as fh:
        found = tomllib.load(fh)["tool"]["importlinter"]["contracts"]
    return {c["type"]: c for c in found}


def test_every_registered_family_is_under_the_family_contracts():
    """Each registered family (``families.NAMES``, those with a folder) is one of the independent
    modules and one of the forbidden ones, as import-linter expands their expressions; no ignored
    import leads into a family (only the seam modules beside the folders may be ignored)."""
    import grimp

    from recurrent_coreai import families

    graph = grimp.build_graph("recurrent_coreai", cache_dir=None)

    def matched(expressions) -> set[str]:
        return {m for e in expressions for m in (graph.find_matching_modules(e) if "*" in e else {e})}

    def in_a_family(module: str) -> bool:
        return any(module == f"recurrent_coreai.families.{n}" or module.startswith(f"recurrent_coreai.families.{n}.")
                   for n in families.NAMES)

    c = contracts()
    independent, forbidden = matched(c["independence"]["modules"]), matched(c["forbidden"]["forbidden_modules"])
    assert families.available(), "no family folder found"
    for name in families.available():
        module = f"recurrent_coreai.families.{name}"
        assert module in independent, f"family {name} is not in the independence contract (pyproject.toml)"
        assert module in forbidden, f"family {name} is not forbidden to the other folders (pyproject.toml)"
    for kind in ("independence", "forbidden"):
        for expression in c[kind].get("ignore_imports", []):
            imported = expression.split("->")[1].strip()
            leads = sorted(m for m in matched([imported]) if in_a_family(m))
            assert not leads and not in_a_family(imported), \
                f"the {kind} contract ignores imports of family modules ({expression}): {leads[:3]}"


def test_a_new_family_folder_is_under_the_contracts_without_a_line_in_pyproject(tmp_path):
    """A planted fourth family (a folder and its NAMES entry, pyproject.toml untouched) that imports
    another family breaks the independence contract, and a stage importing it breaks the forbidden one."""
    copy = tmp_path / "tree"
    copy.mkdir()
    shutil.copy(ROOT / "pyproject.toml", copy)
    shutil.copytree(PACKAGE, copy / PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__"))
    fams = copy / PACKAGE.name / "families"
    (fams / "planted").mkdir()
    (fams / "planted" / "__init__.py").write_text("from recurrent_coreai.families import base  # noqa: F401\n"
                                                   "from recurrent_coreai.families.rwkv6 import geometry  # noqa: F401\n")
    registry = fams / "__init__.py"
    text = registry.read_text()
    assert text.count("NAMES = (") == 1
    registry.write_text(text.replace("NAMES = (", 'NAMES = ("planted", ', 1))
    gate = copy / PACKAGE.name / "stages" / "gate.py"
    gate.write_text(gate.read_text() + "\nfrom recurrent_coreai.families import planted  # noqa: E402,F401\n")
    proc = lint(copy)
    out = " ".join(proc.stdout.split())  # import-linter wraps its lines
    assert proc.returncode != 0
    assert "families: independent of each other BROKEN" in proc.stdout, proc.stdout[-3000:]
    assert "families: reached only through the registry (recurrent_coreai.families.get) BROKEN" in proc.stdout
    assert "recurrent_coreai.families.planted is not allowed to import recurrent_coreai.families.rwkv6" in out
    assert "recurrent_coreai.stages is not allowed to import recurrent_coreai.families.planted" in out
    assert "recurrent_coreai.stages.gate -> recurrent_coreai.families.planted" in out


def neutral_modules() -> list[Path]:
    return sorted(p for folder in NEUTRAL for p in (PACKAGE / folder).rglob("*") if p.is_file()
                  and p.suffix in (".py", ".j2", ".yaml"))


@pytest.mark.parametrize("path", neutral_modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_no_rwkv7_literal_outside_its_family(path):
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if RWKV7_LITERALS.search(line)]
    assert not hits, "RWKV-7 names outside families/rwkv7/: " + "; ".join(hits[:5])


def test_the_literal_check_finds_a_planted_name():
    assert RWKV7_LITERALS.search('states = {"recState": s}')
    assert RWKV7_LITERALS.search("w = sd['model.layers.0.attn.r_proj.weight']")
    assert RWKV7_LITERALS.search("vocab = 'rwkv_vocab.tsv'")
    assert not RWKV7_LITERALS.search("for name, shape in states.items():")


def test_old_environment_names_still_work_with_a_note(monkeypatch, capsys):
    from recurrent_coreai.util import env

    monkeypatch.delenv("RECURRENT_COREAI_PROGRESS", raising=False)
    monkeypatch.setenv("RWKV7_PROGRESS", "0")
    monkeypatch.setattr(env, "_warned", set())
    assert env.get("RECURRENT_COREAI_PROGRESS", "1") == "0"
    assert "RWKV7_PROGRESS is deprecated; use RECURRENT_COREAI_PROGRESS" in capsys.readouterr().err
    monkeypatch.setenv("RECURRENT_COREAI_PROGRESS", "1")
    assert env.get("RECURRENT_COREAI_PROGRESS") == "1"  # the new name wins
