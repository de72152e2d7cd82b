"""dvc.yaml and the Snakefile describe the same DAG."""

from __future__ import annotations

import copy

import pytest
import yaml

from recurrent_coreai import families
from recurrent_coreai.pipeline import config
from recurrent_coreai.pipeline import dag
from recurrent_coreai.pipeline import fingerprint


@pytest.fixture(scope="module")
def jobs(repo_root):
    return dag.snakemake_jobs(repo_root)


def test_committed_dvc_yaml_is_generated_from_the_snakefile(repo_root, jobs):
    assert (repo_root / "dvc.yaml").read_text() == dag.render(jobs, config.read_yaml(repo_root / "config.yaml")), \
        "dvc.yaml is stale: run `python scripts/gen_dvc.py` and commit it"


def test_dvc_parses_the_same_stages(repo_root, jobs, cfg):
    assert dag.drift(jobs, dag.dvc_index(repo_root), cfg) == []


def test_every_stage_kind_is_present(jobs, cfg):
    rules = {j["rule"] for j in jobs}
    assert rules == {"toolchain", "source", "vocab", "reference", "export", "aot", "gate_shard", "gate", "doctor",
                     "card", "report", "stage_and_push", "publish"}
    # one export per recipe of each model the default builds: a tiny model of every registered family
    # (and the trained RWKV-7 fixture, rwkv7-trained)
    built = [m for m, spec in cfg["models"].items() if spec.get("enabled")]
    assert sorted(cfg["models"][m]["family"] for m in built) == sorted([*families.NAMES, "rwkv7"])
    n = sum(len(cfg["models"][m]["recipes"]) for m in built)
    assert sum(j["rule"] == "export" for j in jobs) == n == 3 * len(built)
    # every default gate is one shard (gate/shard_seconds against the cost model), gathered by its gate
    assert sorted(j["wildcards"]["shard"] for j in jobs if j["rule"] == "gate_shard") == ["0"] * n
    assert all(len([d for d in j["deps"] if "/shard-" in d]) == 1 for j in jobs if j["rule"] == "gate")


def test_metrics_and_plots_and_params(repo_root):
    stages = yaml.safe_load((repo_root / "dvc.yaml").read_text())["stages"]
    gate = stages["gate-rwkv7-tiny-fp16"]
    assert gate["metrics"] == [{"results/rwkv7-tiny/gate/fp16.json": {"cache": True}}]
    assert list(gate["plots"][0]) == ["results/rwkv7-tiny/gate/fp16.tsv"]
    assert stages["export-rwkv7-tiny-int8keepproj"]["params"] == [
        {"config.yaml": ["models.rwkv7-tiny.dir", "models.rwkv7-tiny.family", "prefill.chunk",
                         "recipes.int8keepproj"]}]


def _index_from(jobs, cfg):
    """What DVC would parse from a dvc.yaml in agreement with ``jobs``: each job's inputs and its
    code set's file (pipeline/code_groups.py), and the `code` stage that writes those."""
    from recurrent_coreai.pipeline import code_groups

    index = {dag.stage_name(j): {"cmd": j["cmd"],
                                 "deps": sorted({*j["deps"], code_groups.path("results", dag.code_group(j, cfg))}),
                                 "outs": sorted(j["outs"])} for j in jobs if j["cmd"]}
    return {code_groups.STAGE: dag.code_stage(jobs, cfg), **index}


@pytest.mark.parametrize("damage, needle", [
    (lambda ix: ix.pop("vocab-rwkv7-tiny"), "stage vocab-rwkv7-tiny is in the Snakefile but not in dvc.yaml"),
    (lambda ix: ix.__setitem__("extra", {"cmd": "true", "deps": [], "outs": []}), "stage extra is in dvc.yaml"),
    (lambda ix: ix["export-rwkv7-tiny-fp16"].__setitem__("cmd", "python scripts/export.py --recipe fp32"),
     "stage export-rwkv7-tiny-fp16: cmd differs"),
    (lambda ix: ix["gate-rwkv7-tiny-fp32"]["deps"].pop(), "stage gate-rwkv7-tiny-fp32: deps"),
    (lambda ix: ix["card-rwkv7-tiny"].__setitem__("outs", ["elsewhere.md"]), "stage card-rwkv7-tiny: outs"),
    (lambda ix: ix.pop("code"), "stage code (the code each stage runs) is not in dvc.yaml"),
    (lambda ix: ix["code"]["deps"].remove("recurrent_coreai/families/rwkv7/reference.py"), "stage code: deps differ"),
    (lambda ix: ix["code"]["outs"].pop(), "stage code: outs differ"),
    (lambda ix: ix["export-rwkv7-tiny-fp16"]["deps"].remove("results/code/export.rwkv7.md5"),
     "stage export-rwkv7-tiny-fp16: deps"),
])
def test_drift_is_detected(jobs, damage, needle, cfg):
    index = copy.deepcopy(_index_from(jobs, cfg))
    assert dag.drift(jobs, index, cfg) == []
    damage(index)
    assert any(needle in p for p in dag.drift(jobs, index, cfg))


def test_a_param_key_config_yaml_lacks_is_not_given_to_dvc():
    """DVC refuses a params key missing from the file: optional keys (models.<m>.shipped) are
    listed only where config.yaml sets them."""
    cfg = {"models": {"m": {"dir": "m", "shipped": "fp16"}}, "recipes": {"fp16": {}}, "prefill": {"chunk": 64}}
    assert dag.param_keys("export", {"model": "m", "recipe": "fp16"}, cfg) == [
        "models.m.dir", "models.m.shipped", "prefill.chunk", "recipes.fp16"]
    del cfg["models"]["m"]["shipped"]
    assert "models.m.shipped" not in dag.param_keys("export", {"model": "m", "recipe": "fp16"}, cfg)


@pytest.mark.parametrize("rule", sorted(fingerprint.ENTRY))
def test_each_stage_fingerprints_its_own_code_and_no_other_stages(rule):
    """A stage's code fingerprint (Snakemake params: code, DVC deps) covers its script and the
    module holding its main, and no other stage's: editing one stage reruns that stage only
    (end to end for a sample: tests/test_pipeline_integration.py) -- and the publish stage,
    which attests the code of every stage that built its bundles (provenance)."""
    script, module = fingerprint.ENTRY[rule]
    files = set(fingerprint.code_files(rule))
    assert {f"scripts/{script}.py", f"recurrent_coreai/{module.replace('.', '/')}.py"} <= files
    assert module in fingerprint.modules(rule)
    attested = fingerprint.ATTESTED if rule == "stage_and_push" else ()
    others = {f"scripts/{s}.py" for r, (s, _) in fingerprint.ENTRY.items() if r != rule and r not in attested}
    with_family = set(fingerprint.code_files(rule, "rwkv7"))
    for fs in (files, with_family):
        assert not fs & others, f"{rule} also fingerprints {sorted(fs & others)}"
    for other in attested:  # publish: all of each attested stage's code, with the family's
        assert set(fingerprint.code_files(other, "rwkv7")) <= with_family, other
    if rule in fingerprint.TOKENIZER_RULES:  # a model's tokenizer kind is loaded by name: it counts too
        kind = f"recurrent_coreai/{fingerprint.tokenizer_module('mamba2').replace('.', '/')}.py"
        assert kind in fingerprint.code_files(rule, "mamba2") and kind not in fingerprint.code_files(rule, "rwkv7")
    before = fingerprint.digest(rule)
    assert len(before) == 64 and before == fingerprint.digest(rule)
    # a family's folder counts for the stages that run family code, and only for those
    family_init = "recurrent_coreai/families/rwkv7/__init__.py"
    if rule in fingerprint.FAMILY_RULES:
        assert files < with_family and family_init in with_family
        assert fingerprint.digest(rule, "rwkv7") != before
    else:
        assert with_family == files and fingerprint.digest(rule, "rwkv7") == before
