"""envs/*.yaml pin exactly what requirements.txt pins (and the toolchain pins are the mandated ones)."""

from __future__ import annotations

import yaml


def _pins(lines):
    return sorted(line.strip() for line in lines if "==" in line and not line.strip().startswith("#"))


def test_conda_envs_match_requirements(repo_root):
    reqs = _pins((repo_root / "requirements.txt").read_text().splitlines())
    envs = sorted((repo_root / "envs").glob("*.yaml"))
    assert envs, "no conda env specs"
    for env in envs:
        spec = yaml.safe_load(env.read_text())
        pip = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict) and "pip" in d)
        assert _pins(pip) == reqs, env.name
        assert "python=3.11" in spec["dependencies"]


def test_toolchain_pins(repo_root):
    reqs = set(_pins((repo_root / "requirements.txt").read_text().splitlines()))
    for pin in ("torch==2.13.0", "coreai-core==1.0.0b3", "coreai-torch==0.4.3", "coreai-opt==0.4.0"):
        assert pin in reqs


def test_installed_versions_match_pins(repo_root):
    import importlib.metadata

    for pin in _pins((repo_root / "requirements.txt").read_text().splitlines()):
        name, version = pin.split("==")
        assert importlib.metadata.version(name).split("+")[0] == version, name


def test_every_rule_declares_a_conda_env_and_a_log(repo_root):
    for smk in (repo_root / "rules").glob("*.smk"):
        text = smk.read_text()
        for block in text.split("\nrule ")[1:]:
            assert "    log:" in block and "    conda:" in block, f"{smk.name}: rule {block.split(':')[0]}"
