"""The peer lint (coreai doctor, coreai-cli): nothing on our export source, checkpoint and bundles
(keep it so); a source with a known trap fails the stage with exit 2 and one line."""

from __future__ import annotations

import json

import pytest

from recurrent_coreai import families
from recurrent_coreai.stages import doctor
from recurrent_coreai.pipeline.paths import Layout

RESULTS = None  # the tiny results tree (conftest)
M = "rwkv7-tiny"
SOURCES = families.get("rwkv7").doctor_sources()  # what the doctor rule passes as --sources


def _args(repo_root, out, sources=None, **kw):
    argv = ["--config-file", str(RESULTS.parent / "config.yaml"), "--model", M, "--recipe", kw.pop("recipe", "fp32"),
            "--sources", *map(str, sources or [repo_root / s for s in SOURCES]), "--out", str(out)]
    for k, v in kw.items():
        argv += [f"--{k}", str(v)]
    return argv


@pytest.mark.parametrize("recipe", ["fp32", "fp16", "int8keepproj"])
def test_no_findings_on_our_source_checkpoint_and_bundles(recipe, repo_root, tmp_path, capfd):
    lay, out = Layout(RESULTS, M), tmp_path / f"{recipe}.doctor.json"
    rc = doctor.main(_args(repo_root, out, recipe=recipe, checkpoint=lay.source, export=lay.export(recipe)))
    assert rc == 0, capfd.readouterr().err
    result = json.loads(out.read_text())
    assert result["findings"] == 0 and result["exit_status"] == 0 and result["tool"] == "coreai-cli 0.1.0"
    kinds = [r["kind"] for r in result["reports"]]
    assert kinds == ["source"] * len(SOURCES) + ["checkpoint", "asset"]
    assert "SRC-F-NORMALIZE" in result["reports"][0]["rules_run"]  # the rule the shipped port once tripped
    assert "IR-040-DEBUG-LOC" in result["reports"][-1]["rules_run"]
    assert result["reports"][-1]["target"] == str(lay.export(recipe) / f"rwkv7-tiny-{recipe}.aimodel")  # as given


def test_a_known_trap_fails_with_exit_2_and_one_line(repo_root, tmp_path, capfd):
    bad = tmp_path / "graph.py"
    bad.write_text("import torch.nn.functional as F\n\n\ndef kk(k):\n    return F.normalize(k, dim=-1)\n")
    out = tmp_path / "fp32.doctor.json"
    rc = doctor.main(_args(repo_root, out, sources=[repo_root / SOURCES[0], bad]))
    err = capfd.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith(f"error: {bad}:5: coreai doctor SRC-F-NORMALIZE (silent): ")
    assert "return F.normalize(k, dim=-1) -- fix: " in err
    assert not out.exists()


def test_a_target_doctor_cannot_read_is_one_line(repo_root, tmp_path, capfd):
    rc = doctor.main(_args(repo_root, tmp_path / "x.json", sources=[tmp_path / "missing.py"]))
    err = capfd.readouterr().err
    assert rc == 1 and err.count("\n") == 1
    assert err.startswith(f"error: {tmp_path / 'missing.py'}: coreai doctor gave no report (no such path: ")
