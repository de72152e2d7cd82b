"""The package's layers and seams, as tests (docs/architecture.md).

* import-linter's contracts (pyproject.toml ``[tool.importlinter]``) hold, and breaking one on
  purpose -- a stage importing a family module -- fails them;
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
