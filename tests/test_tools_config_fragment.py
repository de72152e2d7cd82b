"""``generate`` and ``status`` with a model added by a ``--configfile`` fragment (issue 34, case 14;
docs/bad-inputs.md row N16): ``--config-file fragment.yaml`` is merged over config.yaml as
``snakemake --configfile`` merges it (config.load_for_tool) -- it was validated alone, and refused
with "'results' is a required property". A whole config (with ``results:``) is read as it is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.tools import generate as gen
from recurrent_coreai.tools import status

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"enabled": False, "family": "rwkv7", "tokenizer": "bytes", "dir": "added", "license": "mit",
         "source": {"kind": "synthetic", "seed": 3, "shape": {"layers": 1, "hidden": 64, "head_dim": 32, "ffn": 128,
                                                               "vocab": 256, "decay_lora": 8, "a_lora": 8, "v_lora": 8,
                                                               "gate_lora": 8}},
         "recipes": ["fp32"], "targets": ["universal"], "publish": {"repo": None, "push": False}}


@pytest.fixture
def fragment(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(ROOT)  # config.yaml is read from the working directory, as Snakemake reads it
    path = tmp_path / "added.yaml"
    path.write_text(yaml.safe_dump({"models": {"added": MODEL}, "gate": {"steps": 200}}))
    return path


def test_a_fragment_is_merged_over_config_yaml(fragment):
    cfg = cfgmod.load_for_tool(fragment)
    base = cfgmod.load(ROOT / "config.yaml")
    assert cfgmod.origin(cfg) == f"config.yaml + {fragment}"
    assert cfg["models"]["added"]["dir"] == "added" and set(base["models"]) < set(cfg["models"])
    assert cfg["gate"]["steps"] == 200 and cfg["gate"]["prompts"] == base["gate"]["prompts"]  # key by key
    assert cfg["results"] == base["results"]
    whole = dict(yaml.safe_load((ROOT / "config.yaml").read_text()), results=str(fragment.parent / "res"))
    (fragment.parent / "whole.yaml").write_text(yaml.safe_dump(whole))
    assert cfgmod.load_for_tool(fragment.parent / "whole.yaml")["results"] == str(fragment.parent / "res")
    assert cfgmod.origin(cfgmod.load_for_tool(ROOT / "config.yaml")).endswith("config.yaml")


def test_a_bad_fragment_is_one_line_naming_both_files(fragment, capsys):
    fragment.write_text(yaml.safe_dump({"models": {"added": {**MODEL, "recipes": ["int3"]}}}))
    rc = status.main(["--config-file", str(fragment)])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith(f"error: config.yaml + {fragment}: models/added uses unknown recipe 'int3'"), err


def test_status_lists_a_model_of_a_fragment(fragment, capsys):
    found = status.survey(cfgmod.load_for_tool(fragment), ROOT)
    assert [r for r in found.rows if r["model"] == "added"] == []  # not enabled, nothing built: no row
    fragment.write_text(yaml.safe_dump({"models": {"added": MODEL}, "build": ["added"]}))
    rows = [r for r in status.survey(cfgmod.load_for_tool(fragment), ROOT).rows if r["model"] == "added"]
    assert [(r["recipe"], r["built"], r["gate"]) for r in rows] == [("fp32", "no", "-")]


def test_generate_reads_a_model_of_a_fragment(fragment, capsys):
    """Past the config: the model is known, its bundle is not built yet (one line saying how)."""
    rc = gen.main(["--config-file", str(fragment), "--model", "added", "--recipe", "fp32", "hello"])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert "required property" not in err and "unknown model" not in err, err
    assert "results/added/" in err and "snakemake" in err, err


def test_the_status_command_with_a_fragment(fragment):
    proc = subprocess.run([sys.executable, "-m", "recurrent_coreai", "status", "--config-file", str(fragment)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "required property" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith("model"), proc.stdout[:500]
