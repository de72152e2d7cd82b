"""Config validation: the schema (as Snakemake applies it) and the cross-references."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import yaml

from recurrent_coreai import families
from recurrent_coreai.pipeline import config
from recurrent_coreai.util.errors import PipelineError


@pytest.fixture()
def raw(repo_root):
    return yaml.safe_load((repo_root / "config.yaml").read_text())


def test_shipped_config_is_valid(cfg):
    built = config.models_to_build(cfg)   # the offline default: one synthetic model per registered family,
    synthetic = [m for m in built if cfg["models"][m]["source"]["kind"] == "synthetic"]  # and a trained fixture
    assert sorted(cfg["models"][m]["family"] for m in synthetic) == sorted(families.available())
    assert [m for m in built if m not in synthetic] == ["rwkv7-trained"]
    assert cfg["models"]["rwkv7-trained"]["source"] == {"kind": "path", "path": "fixtures/trained/rwkv7/model.pth"}
    goose = cfg["models"]["rwkv7-goose-1.5b"]
    assert goose["source"]["repo"] == "RWKV/RWKV7-Goose-World3-1.5B-HF"
    assert config.HEX40.match(goose["source"]["revision"])
    assert goose["targets"] == ["h18p"] and goose["publish"]["repo"] == "mlboydaisuke/RWKV7-Goose-1.5B-CoreAI"
    assert cfg["models"]["rwkv7-tiny"]["recipes"] == ["fp32", "fp16", "int8keepproj"]
    for name in ("fp32", "fp16", "int8keepproj", "int8", "int4keepproj"):
        assert name in cfg["recipes"] and name in cfg["gate"]["thresholds"]


# What mlboydaisuke/RWKV7-Goose-1.5B-CoreAI ships, file by file where apps load them by path.
SHIPPED_1_5B = ["aimodel/rwkv7_goose_1_5b/rwkv7_goose_1_5b.aimodel", "aimodel/rwkv7_goose_1_5b-fp16/rwkv7_goose_1_5b-fp16.aimodel",
                "h18p/rwkv7_goose_1_5b-fp16/rwkv7_goose_1_5b-fp16.h18p.aimodelc", "h18p/rwkv7_goose_1_5b-fp16/rwkv_vocab.tsv",
                "h18p/rwkv7_goose_1_5b/rwkv7_goose_1_5b.h18p.aimodelc", "h18p/rwkv7_goose_1_5b/rwkv_vocab.tsv"]


@pytest.mark.parametrize("model", ["rwkv7-goose-1.5b", "rwkv7-1.5b-shape"])
def test_the_1_5b_entries_stage_the_shipped_repos_layout(cfg, model):
    """The shipped recipe (int8keepproj) under the bare name, other recipes suffixed; each
    target's folder holds <bundle>.<target>.aimodelc beside the vocabulary (what publish stages:
    tests/test_publish.py checks the staged tree against paths.published_folders)."""
    from recurrent_coreai.pipeline.paths import bundle_name, published_folders
    from recurrent_coreai.tokenizers.world import DEVICE_FILE as VOCAB_TSV

    m = cfg["models"][model]
    assert (m["dir"], m["shipped"], m["recipes"]) == ("rwkv7_goose_1_5b", "int8keepproj", ["fp16", "int8keepproj"])
    staged = []
    for folder in published_folders(m, ["h18p"]):
        kind, bundle = folder.split("/")
        assert bundle in {bundle_name(m, r) for r in m["recipes"]}
        staged += [f"{folder}/{bundle}.aimodel"] if kind == "aimodel" else [f"{folder}/{bundle}.{kind}.aimodelc",
                                                                              f"{folder}/{VOCAB_TSV}"]
    assert sorted(staged) == sorted(SHIPPED_1_5B)


def test_the_1_5b_shape_entry_has_the_real_geometry(cfg):
    from recurrent_coreai import families

    family = families.get(cfg["models"]["rwkv7-1.5b-shape"]["family"])
    src = cfg["models"]["rwkv7-1.5b-shape"]["source"]
    assert src["kind"] == "synthetic" and src["layout"] == "fla-packed"
    assert src["shape"] == {"layers": 24, "hidden": 2048, "head_dim": 64, "ffn": 8192, "vocab": 65536,
                            "decay_lora": 96, "a_lora": 96, "v_lora": 64, "gate_lora": 256}
    assert family.parameter_count(family.geometry_from_shape(src["shape"], "config.yaml")) == 1_527_404_544  # the real 1.5B's count: ~6.1 GB in fp32


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
    (lambda c: c["models"]["rwkv7-tiny"].__setitem__("shipped", "int8"), "shipped 'int8' is not one of its recipes"),
    (lambda c: c["models"]["rwkv7-tiny"].__setitem__("gate", {"why": "measured: see the README's gate section",
                                                              "thresholds": {"int8": {"min_agree": 0.9, "min_counted": 0.8,
                                                                                      "prefill_max_rel_dstate": 0.03}}}),
     "gate/thresholds/int8: the model does not build 'int8'"),
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
    assert proc.returncode == 1
    assert _errors(proc) == [f"error: {bad}: invalid value at gate/steps: -3 is less than "
                                        "the minimum of 1 -- fix: correct it as recurrent_coreai/pipeline/schemas/config.schema.yaml "
                                        "describes"], proc.stderr


@pytest.mark.parametrize("mutate, needle", [
    (lambda c, t: c["recipes"].__setitem__("../../../../esc", {"dtype": "float32"}),
     "invalid value at recipes: '../../../../esc' does not match"),
    (lambda c, t: c["targets"].__setitem__("a/b", {"kind": "linux"}), "invalid value at targets: 'a/b' does not match"),
    (lambda c, t: c["models"].__setitem__("../m", c["models"]["rwkv7-tiny"]), "invalid value at models: '../m'"),
    (lambda c, t: c["recipes"]["int8"]["quantize"].__setitem__("include", ["(ffn"]),
     "recipes/int8/quantize/include: '(ffn' is not a valid regular expression"),
    (lambda c, t: c.__setitem__("results", str(t)), "is a file, not a directory"),
    (lambda c, t: c["models"]["rwkv7-tiny"]["source"].__setitem__("kind", "ftp"),
     "models/rwkv7-tiny/source: kind 'ftp' is not one of synthetic, hf, path"),
])
def test_names_paths_and_patterns_are_checked_at_config_time(raw, tmp_path, mutate, needle):
    a_file = tmp_path / "results"
    a_file.write_text("not a directory")
    mutate(raw, a_file)
    with pytest.raises(PipelineError) as exc:
        config.validate(raw, "config.yaml")
    assert needle in str(exc.value) and "-- fix: " in str(exc.value) and "\n" not in str(exc.value)


def _errors(proc) -> list[str]:
    """stderr less Snakemake's own notice about the workflow profile."""
    return [line for line in proc.stderr.splitlines() if not line.startswith("Using workflow specific profile")]


def _commands(proc) -> list[str]:
    """The shell commands a dry run with -p prints ("Shell command: python scripts/...")."""
    cmds = sorted(line.split("Shell command:", 1)[1].strip() for line in (proc.stdout + proc.stderr).splitlines()
                  if "Shell command: python scripts/" in line)
    assert cmds, "the dry run printed no shell commands"
    return cmds


def test_config_flag_overrides_reach_the_stages_through_one_effective_file(repo_root, tmp_path):
    """--config merges over config.yaml as Snakemake merges it; the stages read that same merged
    config (a content-addressed file), and its origin names what the user gave."""
    proc = _snakemake(repo_root, "publish", "-p", "--config", f"results={tmp_path}/elsewhere")
    assert proc.returncode == 0, proc.stderr[-2000:]
    cmds = _commands(proc)
    models = config.models_to_build(config.load(repo_root / "config.yaml"))
    assert len(models) == len(families.available()) + 1  # and the trained RWKV-7 fixture
    assert cmds and all(any(f"{tmp_path}/elsewhere/{m}" in c for m in models) or "toolchain" in c for c in cmds)
    files = {c.split("--config-file ")[1].split()[0] for c in cmds}
    assert len(files) == 1 and next(iter(files)).startswith(".snakemake/rwkv7/config-")
    loaded = config.load(repo_root / files.pop())
    assert loaded["results"] == f"{tmp_path}/elsewhere" and config.origin(loaded) == "config.yaml + --config"


def test_naming_config_yaml_or_nothing_gives_the_same_commands(repo_root):
    plain = _snakemake(repo_root, "publish", "-p", "--forceall")
    named = _snakemake(repo_root, "publish", "-p", "--forceall", "--configfile", "config.yaml")
    assert plain.returncode == 0 and named.returncode == 0, named.stderr[-2000:]
    assert _commands(plain) == _commands(named) and all("--config-file config.yaml " in c for c in _commands(plain))


def test_a_config_file_holding_only_one_model_merges_and_builds_it(repo_root, raw, tmp_path):
    """Snakemake deep-merges --configfile over config.yaml; the stages see the same merge, so the
    new model builds (here: its source) and config.yaml's model is planned too."""
    own = {"results": str(tmp_path / "res"), "models": {"t": {
        "family": "rwkv7", "enabled": True, "dir": "t", "source": {"kind": "synthetic", "seed": 7, "shape": {
            "layers": 1, "hidden": 64, "head_dim": 64, "ffn": 128, "vocab": 65536,
            "decay_lora": 8, "a_lora": 8, "v_lora": 8, "gate_lora": 8}},
        "recipes": ["fp32"], "targets": ["universal"], "publish": {"repo": None, "push": False}}}}
    it = tmp_path / "it.yaml"
    it.write_text(yaml.safe_dump(own))
    plan = _snakemake(repo_root, "publish", "--configfile", str(it))
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert f"{tmp_path}/res/t/export/fp32" in plan.stdout and f"{tmp_path}/res/rwkv7-tiny/export/fp16" in plan.stdout
    env = dict(os.environ, PATH=f"{repo_root / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", f"{tmp_path}/res/t/source",
                           "--configfile", str(it)], cwd=repo_root, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "res" / "t" / "source" / "model.safetensors").is_file()
    assert "DVC: not recorded: this run's config differs from config.yaml" in proc.stderr


def test_invalid_yaml_names_the_file_and_line(repo_root, tmp_path):
    from recurrent_coreai.pipeline.config import read_yaml

    bad = tmp_path / "config.yaml"
    bad.write_text("results: results\nmodels: [1, 2\nbuild: []\n")
    with pytest.raises(PipelineError) as exc:
        read_yaml(bad)
    assert str(exc.value).startswith(f"{bad}: invalid YAML at line 3") and "\n" not in str(exc.value)
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--snakefile",
                           str(repo_root / "Snakefile"), "--directory", str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert _errors(proc) == [f"error: {exc.value}".replace(str(bad), "config.yaml")]


def test_snakemake_accepts_another_config_file_and_build_override(repo_root, raw, tmp_path):
    raw["results"] = str(tmp_path / "res")
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(raw))
    proc = _snakemake(repo_root, "publish", "--configfile", str(other), "--config", 'build=["rwkv7-tiny"]')
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{tmp_path}/res/rwkv7-tiny/export/fp16" in proc.stdout


def test_a_models_own_gate_thresholds_replace_the_global_ones_for_that_model_only(raw):
    """models/<model>/gate: the gate of that model and recipe gets those thresholds and the why;
    every other model and recipe keeps gate/thresholds; the key is one of the gate stage's params."""
    own = {"min_agree": 0.95, "min_counted": 0.8, "max_abs_dlogits": None, "prefill_max_rel_dstate": 0.03}
    raw["models"]["rwkv7-tiny"]["gate"] = {"thresholds": {"int8keepproj": own}, "why": "random weights: see README"}
    cfg = config.validate(copy.deepcopy(raw), "config.yaml")

    def gate(model, recipe):
        return config.gate_settings(config.settings(cfg, "gate", model=model, recipe=recipe), recipe)

    assert gate("rwkv7-tiny", "int8keepproj")["thresholds"] == own
    assert gate("rwkv7-tiny", "int8keepproj")["thresholds_why"] == "random weights: see README"
    assert gate("rwkv7-tiny", "fp16")["thresholds"] == raw["gate"]["thresholds"]["fp16"]
    assert "thresholds_why" not in gate("rwkv7-tiny", "fp16")
    assert gate("rwkv7-goose-1.5b", "int8keepproj")["thresholds"] == raw["gate"]["thresholds"]["int8keepproj"]
    assert "thresholds_why" not in gate("rwkv7-goose-1.5b", "int8keepproj")
    # the shipped config: only two synthetic stand-ins set their own, each for its int8 recipe only
    # (the recipe's own error on random weights, measured: config.yaml's why)
    assert {m for m in raw["models"] if "gate" in raw["models"][m]} == {"rwkv7-1.5b-shape", "mamba2-1.3b-shape",
                                                                         "rwkv7-tiny"}
    assert list(raw["models"]["rwkv7-1.5b-shape"]["gate"]["thresholds"]) == ["int8keepproj"]
    assert list(raw["models"]["mamba2-1.3b-shape"]["gate"]["thresholds"]) == ["int8keepstate"]
    assert gate("mamba2-1.3b-shape", "fp16")["thresholds"] == raw["gate"]["thresholds"]["fp16"]
    assert gate("rwkv7-1.5b-shape", "fp16")["thresholds"] == raw["gate"]["thresholds"]["fp16"]
    # and compares all 127 steps of both recipes: the gate runs as shards (docs/gate.md), so the 80 steps
    # it once set to fit 30 minutes on 2 cores are gone (issue 27)
    assert (gate("rwkv7-1.5b-shape", "int8keepproj")["steps"], gate("rwkv7-1.5b-shape", "fp16")["steps"]) == (127, 127)
    assert "steps" not in raw["models"]["rwkv7-1.5b-shape"]["gate"]
    assert ("models", "rwkv7-tiny", "gate") in config.stage_keys("gate", model="rwkv7-tiny", recipe="fp16")


def test_a_models_gate_thresholds_need_a_why(raw):
    raw["models"]["rwkv7-tiny"]["gate"] = {"thresholds": {"fp16": {"min_agree": 0.9, "min_counted": 0.8,
                                                                     "prefill_max_rel_dstate": 0.03}}}
    with pytest.raises(PipelineError, match="why"):
        config.validate(copy.deepcopy(raw), "config.yaml")


def test_a_models_own_gate_steps_apply_to_that_model_and_recipe_only(raw):
    raw["models"]["rwkv7-tiny"]["gate"] = {"steps": {"int8keepproj": 80}, "why": "measured: see the README's scale"}
    cfg = config.validate(copy.deepcopy(raw), "config.yaml")

    def gate(model, recipe):
        return config.gate_settings(config.settings(cfg, "gate", model=model, recipe=recipe), recipe)

    own = gate("rwkv7-tiny", "int8keepproj")
    assert (own["steps"], own["steps_why"]) == (80, "measured: see the README's scale")
    assert own["thresholds"] == raw["gate"]["thresholds"]["int8keepproj"] and "thresholds_why" not in own
    for model, recipe in (("rwkv7-tiny", "fp16"), ("rwkv7-goose-1.5b", "int8keepproj")):
        assert gate(model, recipe)["steps"] == raw["gate"]["steps"] and "steps_why" not in gate(model, recipe)

# --- the prompts' shares of gate.steps (config.prompt_budgets) ------------------------------------
def test_prompts_that_fit_get_the_equal_shares_as_before():
    """Each prompt's need (its tokens plus one generated step) fits its equal share: the equal
    shares, the first prompts taking the remainder, whatever the token counts (so the default
    models' reference streams are what they were)."""
    assert config.prompt_budgets([0, 0, 0, 0], 127) == [32, 32, 32, 31] and config.prompt_budgets([0, 0], 5) == [3, 2]
    assert config.prompt_budgets([13, 15, 13, 19], 127) == [32, 32, 32, 31]   # rwkv7-tiny's World prompts
    assert config.prompt_budgets([18, 20, 17, 26], 127) == [32, 32, 32, 31]   # gdn-tiny's, the longest default
    assert config.prompt_budgets([31, 31, 31, 30], 127) == [32, 32, 32, 31]   # every need exactly its share
    assert config.prompt_budgets([13, 13], 28) == [14, 14]


def test_a_long_prompt_gets_its_tokens_and_a_step_from_the_others_continuations():
    """Issue 27 item 4b: a Mamba-2 with a 566-id tokenizer writes prompt 0 as 35 tokens, more than
    its equal share (32) of 127; it gets 36 (35 + one generated step), the others share the 91 left."""
    assert config.prompt_budgets([35, 12, 14, 20], 127) == [36, 31, 30, 30]
    assert config.prompt_budgets([31, 12, 14, 20], 127) == [32, 32, 32, 31]   # 31 + 1 still fits its 32
    assert config.prompt_budgets([32, 12, 14, 20], 127) == [33, 32, 31, 31]   # 32 + 1 does not
    # taking steps from the others can push another over its smaller share: it gets its need too
    assert config.prompt_budgets([40, 29, 5, 5], 127) == [41, 30, 28, 28]
    assert config.prompt_budgets([60, 60, 1, 1], 127) == [61, 61, 3, 2]
    assert config.prompt_budgets([35, 12, 14, 20], 100) == [36, 22, 21, 21]
    assert config.prompt_budgets([35, 12, 14, 20], 85) == [36, 13, 15, 21]   # exactly the needs: each one step


@pytest.mark.parametrize("tokens", [[0] * 4, [13, 15, 13, 19], [35, 12, 14, 20], [60, 3, 3, 3], [9, 50, 2, 30]])
def test_the_shares_always_add_up_and_fit_every_prompt(tokens):
    for steps in range(sum(t + 1 for t in tokens), 200):
        shares = config.prompt_budgets(tokens, steps)
        assert sum(shares) == steps and all(s >= t + 1 for s, t in zip(shares, tokens)), (steps, shares)
        if steps > sum(t + 1 for t in tokens):   # fewer steps never give a prompt more: a reference of
            fewer = config.prompt_budgets(tokens, steps - 1)   # gate.steps holds every fewer count's steps
            assert all(f <= s for f, s in zip(fewer, shares)), (steps, fewer, shares)


def test_prompts_that_cannot_fit_together_are_refused_in_one_line():
    with pytest.raises(PipelineError) as exc:
        config.prompt_budgets([35, 40, 30, 20], 127, "config.yaml")
    assert str(exc.value) == ("config.yaml: gate.prompts are 35, 40, 30, 20 tokens: with one generated step each they "
                              "need 129 steps, more than gate.steps=127 -- fix: raise gate.steps to at least 129 or "
                              "shorten the prompts")
    assert config.prompt_budgets([35, 40, 30, 20], 129) == [36, 41, 31, 21]
    with pytest.raises(PipelineError, match=r"more than models/m/gate/steps/fp16=80 -- fix: raise "
                                            r"models/m/gate/steps/fp16 to at least 85"):
        config.prompt_budgets([35, 12, 14, 20], 80, "config.yaml", "models/m/gate/steps/fp16")


@pytest.mark.parametrize("own, needle", [
    ({"steps": {"int8": 80}, "why": "measured: see the README's scale"}, "gate/steps/int8: the model does not build"),
    ({"steps": {"fp16": 128}, "why": "measured: see the README's scale"},
     r"gate/steps/fp16 is 128: .* fix: use 4\.\.127, or remove the entry"),
    ({"steps": {"fp16": 3}, "why": "measured: see the README's scale"}, "gate/steps/fp16 is 3"),
    ({"steps": {"fp16": 80}}, "why"),
    ({"why": "measured: see the README's scale"}, "models/rwkv7-tiny/gate"),
])
def test_a_models_own_gate_steps_are_checked(raw, own, needle):
    raw["models"]["rwkv7-tiny"]["gate"] = own
    with pytest.raises(PipelineError, match=needle):
        config.validate(copy.deepcopy(raw), "config.yaml")


def test_a_models_own_steps_are_checked_only_when_it_is_built(raw):
    """A shorter gate.steps (the tests' 40) leaves a disabled model's own 80 alone; building it
    with that gate is the one-line error."""
    raw["models"]["rwkv7-1.5b-shape"]["gate"]["steps"] = {"int8keepproj": 80}
    raw["gate"]["steps"] = 40
    config.validate(copy.deepcopy(raw), "config.yaml")
    raw["build"] = ["rwkv7-1.5b-shape"]
    with pytest.raises(PipelineError, match=r"models/rwkv7-1.5b-shape/gate/steps/int8keepproj is 80: .* fix: use "
                                            r"4\.\.40, or remove the entry"):
        config.validate(copy.deepcopy(raw), "config.yaml")
