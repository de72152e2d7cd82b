"""A model moved from a ``--configfile`` fragment into config.yaml with the same settings reruns
nothing (issue 34, case 10; docs/bad-inputs.md row N11): which file a stage reads its settings from
is no Snakemake param (the commands name ``{resources.config_file}``: resources are no rerun
trigger); the settings it reads are, by value. With the merged file's path as a param, every job of the model
ran again after the move."""

from __future__ import annotations

from pathlib import Path

import yaml

from repo_copies import fresh_copy, run

MODEL = {"enabled": False, "family": "rwkv7", "tokenizer": "bytes", "dir": "moved",
         "description": "A model first built from a --configfile fragment.", "license": "mit",
         "source": {"kind": "synthetic", "seed": 11, "shape": {"layers": 1, "hidden": 64, "head_dim": 32, "ffn": 128,
                                                                "vocab": 256, "decay_lora": 8, "a_lora": 8,
                                                                "v_lora": 8, "gate_lora": 8}},
         "recipes": ["fp32"], "targets": ["universal"], "publish": {"repo": None, "push": False}}
TARGET = "results/moved/vocab"


def test_a_model_moved_into_config_yaml_with_the_same_settings_reruns_nothing(tmp_path):
    repo = fresh_copy(tmp_path / "repo")
    fragment = tmp_path / "fragment.yaml"
    fragment.write_text(yaml.safe_dump({"models": {"moved": MODEL}}))
    built = run(f"snakemake -p --cores 1 {TARGET} --configfile {fragment}", repo)
    assert (repo / TARGET / "bytes_vocab.tsv").is_file(), built.stderr[-2000:]
    assert "--config-file .snakemake/" in built.stdout + built.stderr  # the merged file, on the command line
    assert "Nothing to be done" in run(f"snakemake -n --cores 1 {TARGET} --configfile {fragment}", repo).stdout
    # the same settings, now in config.yaml: nothing to do
    cfg = yaml.safe_load((repo / "config.yaml").read_text())
    cfg["models"]["moved"] = MODEL
    (repo / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    plan = run(f"snakemake -n --cores 1 {TARGET}", repo)
    assert "Nothing to be done" in plan.stdout, plan.stdout[-3000:]
    # a setting the stage reads still reruns it (here the source's seed: source and vocab)
    cfg["models"]["moved"]["source"]["seed"] = 12
    (repo / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    plan = run(f"snakemake -n --cores 1 {TARGET}", repo)
    assert "source" in plan.stdout and "Nothing to be done" not in plan.stdout, plan.stdout[-3000:]


def test_no_rule_has_the_config_files_path_as_a_param():
    """Every rule's command names {resources.config_file}; none has a config_file param (a rerun trigger)."""
    rules = Path(__file__).resolve().parents[1] / "rules"
    text = "".join(p.read_text() for p in sorted(rules.glob("*.smk")) if p.name != "common.smk")
    params = [block.split("\n    log:")[0] for block in text.split("    params:")[1:]]
    assert not any("config_file" in block for block in params) and "{params.config_file}" not in text
    assert text.count("--config-file {resources.config_file}") == text.count("python scripts/") == 12
    assert text.count("config_file=CONFIG_FILE,") == 12
