"""The records' key and the gate's shard size as a user sets them wrongly (issue 34, cases 5 and 13;
docs/bad-inputs.md rows N13-N15), each ONE line and exit 1 before any job, no traceback:

* ``RECURRENT_COREAI_RECORD_KEY=`` (set but empty: what an unset CI secret expands to) turned the
  MAC off with no word; now it is refused, by Snakemake at start and by every stage and tool;
* the key set on a tree built without it: Snakemake sized the export from the source's manifest
  inside a resource function (an InputFunctionException traceback); now the manifest's one line;
* ``gate.shard_seconds: 1.0e-320``: the schema accepted it and the shard count overflowed
  (OverflowError); now the schema's minimum of 1 second.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from recurrent_coreai.util import env
from recurrent_coreai.util.errors import PipelineError

from repo_copies import env as copy_env
from repo_copies import fresh_copy, run

ROOT = Path(__file__).resolve().parents[1]
KEY = "RECURRENT_COREAI_RECORD_KEY"
MODEL = {"enabled": False, "family": "rwkv7", "tokenizer": "bytes", "dir": "keyed", "license": "mit",
         "description": "A model built without the records' key.",
         "source": {"kind": "synthetic", "seed": 5, "shape": {"layers": 1, "hidden": 64, "head_dim": 32, "ffn": 128,
                                                               "vocab": 256, "decay_lora": 8, "a_lora": 8, "v_lora": 8,
                                                               "gate_lora": 8}},
         "recipes": ["fp32"], "targets": ["universal"], "publish": {"repo": None, "push": False}}


def _errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_key_is_refused(monkeypatch, value):
    monkeypatch.setenv(KEY, value)
    with pytest.raises(PipelineError) as exc:
        env.record_key()
    assert str(exc.value) == (f"{KEY}: is set but empty: records would be sealed and checked without a MAC -- fix: set "
                              "it to the key (an unset CI secret expands to an empty value), or unset it (unset "
                              f"{KEY}) to seal without one")
    monkeypatch.delenv(KEY)
    assert env.record_key() is None
    monkeypatch.setenv(KEY, "k" * 32)
    assert env.record_key() == b"k" * 32


def test_an_empty_key_stops_snakemake_and_a_stage_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "publish"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=copy_env(**{KEY: ""}))
    assert proc.returncode == 1 and _errors(proc) == [f"error: {KEY}: is set but empty: records would be sealed and "
                                                      "checked without a MAC -- fix: set it to the key (an unset CI "
                                                      "secret expands to an empty value), or unset it (unset "
                                                      f"{KEY}) to seal without one"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    out = tmp_path / "toolchain.json"  # a stage that seals its record
    stage = subprocess.run([sys.executable, "scripts/toolchain.py", "--out", str(out)], cwd=ROOT, capture_output=True,
                           text=True, timeout=300, env=copy_env(**{KEY: ""}))
    assert stage.returncode == 1 and len(stage.stderr.splitlines()) == 1 and f"{KEY}: is set but empty" in stage.stderr
    assert not out.exists()


def test_shard_seconds_below_a_second_is_the_schemas_line(tmp_path):
    frag = tmp_path / "it.yaml"
    frag.write_text(yaml.safe_dump({"gate": {"shard_seconds": 1.0e-320}}))
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "publish", "--configfile",
                           str(frag)], cwd=ROOT, capture_output=True, text=True, timeout=300, env=copy_env())
    assert proc.returncode == 1, proc.stderr[-2000:]
    (line,) = _errors(proc)
    assert line.startswith(f"error: config.yaml + {frag}: invalid value at gate/shard_seconds: 1e-320 is less than the "
                           "minimum of 1 -- fix: "), line
    assert "OverflowError" not in proc.stderr and "Traceback" not in proc.stderr


def test_the_key_set_on_a_tree_built_without_it_is_one_line(tmp_path):
    repo = fresh_copy(tmp_path / "repo", edit=lambda cfg: cfg["models"].update(keyed=MODEL))
    run("snakemake --cores 1 results/keyed/source", repo)  # built without the key
    proc = run("snakemake -n --cores 1 results/keyed/export/fp32", repo, check=False, **{KEY: "k" * 32})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = _errors(proc)
    assert line.startswith("error: results/keyed/source/manifest.json: differs from what the source stage recorded: "
                           f"its MAC is not one made with {KEY}"), line
    assert "InputFunctionException" not in proc.stderr and "Traceback" not in proc.stderr
    assert "Nothing to be done" in run("snakemake -n --cores 1 results/keyed/source", repo).stdout  # unkeyed: fine
