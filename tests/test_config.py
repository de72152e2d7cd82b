"""Config validation: the schema (as Snakemake applies it) and the cross-references."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from rwkv7_coreai import config
from rwkv7_coreai.errors import PipelineError


@pytest.fixture()
def raw(repo_root):
    return yaml.safe_load((repo_root / "config.yaml").read_text())


def test_shipped_config_is_valid(cfg):
    assert config.models_to_build(cfg) == ["rwkv7-tiny"]
    goose = cfg["models"]["rwkv7-goose-1.5b"]
    assert goose["source"]["repo"] == "RWKV/RWKV7-Goose-World3-1.5B-HF"
    assert config.HEX40.match(goose["source"]["revision"])
    assert goose["targets"] == ["h18p"] and goose["publish"]["repo"] == "mlboydaisuke/RWKV7-Goose-1.5B-CoreAI"
    assert cfg["models"]["rwkv7-tiny"]["recipes"] == ["fp32", "fp16", "int8keepproj"]
    for name in ("fp32", "fp16", "int8keepproj", "int8", "int4keepproj"):
        assert name in cfg["recipes"] and name in cfg["gate"]["thresholds"]


def test_build_override_selects_models(raw):
    raw["build"] = ["rwkv7-goose-1.5b"]
    assert config.models_to_build(config.validate(raw)) == ["rwkv7-goose-1.5b"]


@pytest.mark.parametrize("mutate, needle", [
    (lambda c: c["gate"].__setitem__("steps", "many"), "gate/steps"),
    (lambda c: c["models"]["rwkv7-tiny"]["source"].__setitem__("kind", "ftp"), "models/rwkv7-tiny/source"),
    (lambda c: c["recipes"]["fp16"].__setitem__("dtype", "bfloat16"), "recipes/fp16/dtype"),
    (lambda c: c["recipes"]["int8"]["quantize"].__setitem__("bits", 3), "recipes/int8/quantize/bits"),
    (lambda c: c.__setitem__("colour", "blue"), "(top level)"),
    (lambda c: c["vocab"].__setitem__("sha256", "abc"), "vocab/sha256"),
])
def test_schema_errors_name_the_field(raw, mutate, needle):
    mutate(raw)
    with pytest.raises(PipelineError) as exc:
        config.validate(raw, "config.yaml")
    msg = str(exc.value)
    assert msg.startswith("config.yaml: invalid value at ") and needle in msg and "-- fix:" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("mutate, needle", [
    (lambda c: c["models"]["rwkv7-tiny"]["recipes"].append("int3"), "unknown recipe 'int3'"),
    (lambda c: c["models"]["rwkv7-tiny"]["targets"].append("h99x"), "unknown target 'h99x'"),
    (lambda c: c["targets"].__setitem__("h99x", {"kind": "device", "platform": "iOS"}), "not a known iOS architecture"),
    (lambda c: c["models"]["rwkv7-goose-1.5b"]["source"].__setitem__("revision", "main"), "not a full 40-hex commit"),
    (lambda c: c["models"]["rwkv7-goose-1.5b"]["source"].__setitem__("revision", "a1b2c3d"), "not a full 40-hex commit"),
    (lambda c: c.__setitem__("build", ["nope"]), "unknown model 'nope'"),
    (lambda c: c["gate"]["thresholds"].pop("fp16"), "has no gate threshold"),
])
def test_cross_reference_errors(raw, mutate, needle):
    mutate(raw)
    with pytest.raises(PipelineError, match=needle):
        config.validate(copy.deepcopy(raw), "config.yaml")


def _snakemake(repo, *args, cwd=None):
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", *args],
                          cwd=cwd or repo, capture_output=True, text=True, timeout=120)


def test_snakemake_fails_at_start_with_the_schema_message(repo_root, raw, tmp_path):
    raw["gate"]["steps"] = -3
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    proc = _snakemake(repo_root, "publish", "--configfile", str(bad), "--directory", str(tmp_path / "wd"))
    assert proc.returncode != 0
    assert "-3 is less than the minimum of 1" in proc.stderr + proc.stdout


def test_snakemake_refuses_stage_settings_through_config_flag(repo_root, tmp_path):
    proc = _snakemake(repo_root, "publish", "--configfile", str(repo_root / "config.yaml"), "--config",
                      "results=elsewhere", "--directory", str(tmp_path / "wd"))
    assert proc.returncode != 0
    assert "--config may only set `build`" in proc.stderr + proc.stdout


def test_snakemake_accepts_another_config_file_and_build_override(repo_root, raw, tmp_path):
    raw["results"] = str(tmp_path / "res")
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(raw))
    proc = _snakemake(repo_root, "publish", "--configfile", str(other), "--config", 'build=["rwkv7-tiny"]')
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{tmp_path}/res/rwkv7-tiny/export/fp16" in proc.stdout
