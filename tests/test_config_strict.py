"""What the config used to accept silently, now one line each (``error: <where>: <what> -- fix: <fix>``):
NaN and infinities where a number is configured, duplicate YAML keys (in config.yaml and every
--configfile), model names that the results layout already uses, and config files that are
empty or not a mapping. The Snakemake cases run ``snakemake -n`` in a copy of the repository."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from recurrent_coreai.pipeline import config
from recurrent_coreai.util.errors import PipelineError

from repo_copies import env, fresh_copy

ROOT = Path(__file__).resolve().parents[1]
NAN, INF = float("nan"), float("inf")


@pytest.fixture()
def raw():
    return yaml.safe_load((ROOT / "config.yaml").read_text())


@pytest.fixture(scope="module")
def copy_root(tmp_path_factory) -> Path:
    """One copy of the repository for this module's dry runs (none of them writes a result)."""
    return fresh_copy(tmp_path_factory.mktemp("strict") / "repo")


def dry_run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", *args], cwd=repo,
                          env=env(PYTHONPATH=str(repo)), capture_output=True, text=True, timeout=120)


def errors(proc) -> list[str]:
    """stderr less Snakemake's own notice about the workflow profile."""
    return [line for line in proc.stderr.splitlines() if not line.startswith("Using workflow specific profile")]


def one_error(proc) -> str:
    lines = errors(proc)
    assert proc.returncode == 1 and len(lines) == 1, proc.stdout[-1500:] + proc.stderr[-3000:]
    assert lines[0].startswith("error: ") and " -- fix: " in lines[0]
    assert "Building DAG of jobs" not in proc.stdout + proc.stderr, "nothing may be planned"
    return lines[0]


def refused(cfg: dict, where: str = "config.yaml") -> str:
    with pytest.raises(PipelineError) as exc:
        config.validate(copy.deepcopy(cfg), where)
    msg = str(exc.value)
    assert "\n" not in msg and " -- fix: " in msg
    return msg


# --- 1. NaN and infinities -------------------------------------------------------------------

def _set(cfg: dict, path: str, value) -> None:
    *parents, last = path.split("/")
    for part in parents:
        cfg = cfg[part]
    cfg[last] = value


THRESHOLD_OFF = "write a finite number, or null to switch this check off"


@pytest.mark.parametrize("path, value, fix", [
    ("gate/thresholds/fp16/min_agree", NAN, "min_agree cannot be switched off"),
    ("gate/thresholds/fp16/min_agree", INF, "min_agree cannot be switched off"),
    ("gate/thresholds/fp16/max_abs_dlogits", NAN, THRESHOLD_OFF),
    ("gate/thresholds/fp32/max_abs_dlogits", INF, THRESHOLD_OFF),
    ("gate/thresholds/int8/prefill_max_rel_dstate", INF, THRESHOLD_OFF),
    ("gate/thresholds/int8/prefill_max_abs_dstate", NAN, THRESHOLD_OFF),  # the optional absolute bound
    ("models/rwkv7-1.5b-shape/gate/thresholds/int8keepproj/min_agree", NAN, "min_agree cannot be switched off"),
    ("models/rwkv7-1.5b-shape/gate/thresholds/int8keepproj/max_abs_dlogits", NAN, THRESHOLD_OFF),
    ("gate/near_tie_epsilon", INF, "near_tie_epsilon: a finite number >= 0"),
    ("gate/near_tie_epsilon", NAN, "near_tie_epsilon: a finite number >= 0"),
    ("beta_watch/limits/max_agree_drop", NAN, "max_agree_drop: a number in 0..1"),
    ("beta_watch/limits/max_dlogits_factor", INF, "max_dlogits_factor: a finite number >= 1"),
    ("beta_watch/limits/dlogits_floor", NAN, "dlogits_floor: a finite number >= 0"),
    ("models/rwkv7-tiny/device_numbers/tok_per_s", -INF, "write a finite number"),
])
def test_nan_and_infinities_are_refused_where_a_number_is_configured(raw, path, value, fix):
    if path.endswith("device_numbers/tok_per_s"):
        raw["models"]["rwkv7-tiny"]["device_numbers"] = {}
    _set(raw, path, value)
    shown = ".nan" if value != value else (".inf" if value > 0 else "-.inf")
    msg = refused(raw)
    assert msg.startswith(f"config.yaml: {path} is {shown}, not a finite number"), msg
    assert msg.split(" -- fix: ")[1].startswith(fix), msg


def test_the_gate_thresholds_nan_case_exactly(raw):
    """The case that passed the gate: both checks NaN. min_agree (sorted first) is named first."""
    raw["gate"]["thresholds"]["fp16"].update(min_agree=NAN, max_abs_dlogits=NAN)
    assert refused(raw) == (
        "config.yaml: gate/thresholds/fp16/min_agree is .nan, not a finite number (NaN and infinities pass every "
        "range check, so a check set to one is silently off) -- fix: min_agree cannot be switched off: write a "
        "number in 0..1, the share of decode steps (outside near-ties) whose top-1 token must agree; 0 accepts "
        "any agreement")
    raw["gate"]["thresholds"]["fp16"]["min_agree"] = 1.0
    assert refused(raw) == (
        "config.yaml: gate/thresholds/fp16/max_abs_dlogits is .nan, not a finite number (NaN and infinities pass "
        "every range check, so a check set to one is silently off) -- fix: write a finite number, or null to "
        "switch this check off")


def test_finite_numbers_and_null_still_pass(raw):
    raw["gate"]["thresholds"]["fp16"].update(min_agree=0.0, max_abs_dlogits=None, prefill_max_rel_dstate=None,
                                             prefill_max_abs_dstate=None)
    raw["models"]["rwkv7-tiny"]["device_numbers"] = {"tok_per_s": 41.5, "chip": "A18 Pro"}
    config.validate(raw, "config.yaml")


def test_an_integer_field_keeps_its_schema_message(raw):
    raw["gate"]["steps"] = INF
    assert "invalid value at gate/steps: inf is not of type 'integer'" in refused(raw)


def test_nan_in_a_config_file_stops_snakemake_before_any_job(copy_root, tmp_path):
    own = tmp_path / "nan.yaml"
    own.write_text("gate:\n  thresholds:\n    fp16: {min_agree: .nan, max_abs_dlogits: .nan, "
                   "prefill_max_rel_dstate: 0.01}\n")
    line = one_error(dry_run(copy_root, "--configfile", str(own)))
    assert line.startswith(f"error: config.yaml + {own}: gate/thresholds/fp16/min_agree is .nan, not a finite number")
    assert line.endswith("-- fix: min_agree cannot be switched off: write a number in 0..1, the share of decode "
                         "steps (outside near-ties) whose top-1 token must agree; 0 accepts any agreement")


# --- 2. Duplicate YAML keys ------------------------------------------------------------------

def test_a_duplicate_key_names_the_key_and_both_lines(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("results: results\ngate:\n  steps: 127\n  near_tie_epsilon: 0.1\n  steps: 40\n")
    with pytest.raises(PipelineError) as exc:
        config.read_yaml(f)
    assert str(exc.value) == (f"{f}: duplicate key gate/steps at lines 3 and 5 (YAML silently keeps the last one) "
                              "-- fix: keep one of the two")


@pytest.mark.parametrize("text, key, lines", [
    ("gate: {steps: 127, steps: 40}\n", "gate/steps", (1, 1)),
    ("models:\n  a: {dir: a}\n  b: {dir: b}\n  a: {dir: c}\n", "models/a", (2, 4)),
    ("build: []\nbuild: [x]\n", "build", (1, 2)),
    ("l:\n  - {k: 1, k: 2}\n", "l/0/k", (2, 2)),
    ("true: 1\nyes: 2\n", "True", (1, 2)),  # YAML 1.1: both are the boolean true
])
def test_duplicate_keys_anywhere(tmp_path, text, key, lines):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(PipelineError, match=f"duplicate key {key} at lines {lines[0]} and {lines[1]} "):
        config.read_yaml(f)


def test_merge_keys_may_override_and_unique_keys_load_as_before(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("base: &b {a: 1, b: 2}\nover:\n  <<: *b\n  b: 3\n")
    assert config.read_yaml(f) == {"base": {"a": 1, "b": 2}, "over": {"a": 1, "b": 3}}
    assert config.read_yaml(ROOT / "config.yaml") == yaml.safe_load((ROOT / "config.yaml").read_text())


def test_a_duplicate_key_in_a_configfile_stops_snakemake(copy_root, tmp_path):
    own = tmp_path / "dup.yaml"
    own.write_text("gate: {steps: 127, steps: 40}\n")
    assert one_error(dry_run(copy_root, "--configfile", str(own))) == (
        f"error: {own}: duplicate key gate/steps at lines 1 and 1 (YAML silently keeps the last one) -- fix: keep "
        "one of the two")


def test_a_duplicate_key_in_the_second_configfile_stops_snakemake(copy_root, tmp_path):
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("build: [rwkv7-tiny]\n")
    second.write_text("gate:\n  steps: 127\n  steps: 40\n")
    assert one_error(dry_run(copy_root, "--configfile", str(first), str(second))) == (
        f"error: {second}: duplicate key gate/steps at lines 2 and 3 (YAML silently keeps the last one) -- fix: "
        "keep one of the two")


def test_a_duplicate_key_in_a_json_configfile_stops_snakemake(copy_root, tmp_path):
    own = tmp_path / "dup.json"
    own.write_text('{"gate": {"steps": 127,\n\t"steps": 40}}\n')  # a tab: JSON, but not YAML
    line = one_error(dry_run(copy_root, "--configfile", str(own)))
    assert line == (f"error: {own}: duplicate key gate/steps (JSON silently keeps the last one) -- fix: keep one of "
                    "the two")


def test_a_duplicate_key_in_config_yaml_stops_snakemake(copy_root, tmp_path):
    repo = tmp_path / "repo"
    subprocess.run(["cp", "-a", str(copy_root), str(repo)], check=True)
    text = (repo / "config.yaml").read_text()
    assert text.startswith("results: ")
    (repo / "config.yaml").write_text("results: elsewhere\n" + text)
    assert one_error(dry_run(repo)) == ("error: config.yaml: duplicate key results at lines 1 and 2 (YAML silently "
                                        "keeps the last one) -- fix: keep one of the two")


# --- 3. Model names the results layout uses ----------------------------------------------------

def _with_models(raw: dict, *names: str) -> dict:
    for name in names:
        raw["models"][name] = copy.deepcopy(raw["models"]["rwkv7-tiny"])
    return raw


def test_the_reserved_names_come_from_the_layout():
    assert config.reserved_model_names() == {
        "logs": ("results/", "results/logs/ holds every model's job logs"),
        "toolchain.json": ("results/", "results/toolchain.json is the toolchain record"),
        "toolchain.log": ("results/logs/", "results/logs/toolchain.log is the toolchain job's log")}


@pytest.mark.parametrize("name, clash", [
    ("logs", "results/logs/ holds every model's job logs"),
    ("toolchain.json", "results/toolchain.json is the toolchain record"),
    ("toolchain.log", "results/logs/toolchain.log is the toolchain job's log"),
    ("Logs", "results/logs/ holds every model's job logs"),  # macOS: a case-insensitive file system
])
def test_model_names_the_results_layout_uses_are_refused(raw, name, clash):
    assert refused(_with_models(raw, name)).startswith(f"config.yaml: models/{name}: the name is taken: {clash}")


def test_the_logs_and_source_case_exactly(raw):
    assert refused(_with_models(raw, "logs", "source")) == (
        "config.yaml: models/logs: the name is taken: results/logs/ holds every model's job logs, and this model's "
        "outputs would go to results/logs/ -- fix: rename the model (names the results layout uses: logs, "
        "toolchain.json, and toolchain.log for the logs; compared ignoring case)")


def test_model_names_that_differ_only_in_case_are_refused(raw):
    assert refused(_with_models(raw, "Tiny", "tiny")) == (
        "config.yaml: models/Tiny and models/tiny differ only in case: on a case-insensitive file system (macOS) "
        "they share results/tiny/ -- fix: rename one of them")


def test_a_model_named_like_a_results_file_stops_snakemake(copy_root, tmp_path):
    """Before: `logs` + `source` planned 38 jobs whose outputs and logs overlap; `toolchain.json`
    was Snakemake's ChildIOException."""
    tiny = yaml.safe_load((ROOT / "config.yaml").read_text())["models"]["rwkv7-tiny"]
    for names in (["logs", "source"], ["toolchain.json"]):
        own = tmp_path / f"{names[0]}.yaml"
        own.write_text(yaml.safe_dump({"models": {n: tiny for n in names}, "build": names}))
        line = one_error(dry_run(copy_root, "--configfile", str(own)))
        assert line.startswith(f"error: config.yaml + {own}: models/{names[0]}: the name is taken: results/"), line


# --- 4. Config files that are missing, empty, not a mapping or not YAML --------------------------

@pytest.mark.parametrize("text, what", [
    ("", "is empty"),
    ("# only a comment\n", "is empty"),
    ("- a\n- b\n", "the top level is a list, not a mapping"),
    ("just text\n", "the top level is a str, not a mapping"),
])
def test_config_files_that_are_not_a_mapping(tmp_path, text, what):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(PipelineError) as exc:
        config.check_config_files([f])
    assert str(exc.value).startswith(f"{f}: {what}") and " -- fix: " in str(exc.value)


def test_check_config_files_names_a_missing_file_and_a_yaml_error(tmp_path):
    with pytest.raises(PipelineError, match=f"^{tmp_path / 'nope.yaml'}: config file not found"):
        config.check_config_files([tmp_path / "nope.yaml"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("results: [1, 2\n")
    with pytest.raises(PipelineError, match=f"^{bad}: invalid YAML at line 2, column 1: "):
        config.check_config_files([bad])
    good = tmp_path / "good.json"
    good.write_text('{"build":\t["rwkv7-tiny"]}')  # JSON Snakemake reads, though YAML would not
    config.check_config_files([good])


@pytest.mark.parametrize("text, what", [("", "is empty"), ("- a\n", "the top level is a list, not a mapping")])
def test_an_empty_or_listy_config_yaml_stops_snakemake_with_its_name(copy_root, tmp_path, text, what):
    """config.yaml is read by the Snakefile's `configfile:` after our check: one line, not
    Snakemake's "Config file must be given as JSON or YAML with keys at top level"."""
    repo = tmp_path / "repo"
    subprocess.run(["cp", "-a", str(copy_root), str(repo)], check=True)
    (repo / "config.yaml").write_text(text)
    assert one_error(dry_run(repo)).startswith(f"error: config.yaml: {what}")


@pytest.mark.parametrize("text, snakemake_says", [
    (None, "FileNotFoundError: [Errno 2] No such file or directory"),
    ("", "Config file must be given as JSON or YAML with keys at top level."),
    ("results: [1, 2\n", "Config file is not valid JSON or YAML."),
])
def test_a_broken_configfile_is_refused_by_snakemake_before_the_snakefile_runs(copy_root, tmp_path, text,
                                                                                snakemake_says):
    """Snakemake reads every --configfile in its command-line parser (ConfigSettings), before it
    reads the Snakefile: nothing of ours runs, so these keep Snakemake's message. The run stops
    there (exit 1, nothing planned); if this test fails, Snakemake changed and the Snakefile's
    check_config_files can name the file and line for these as well."""
    f = tmp_path / "c.yaml"
    if text is not None:
        f.write_text(text)
    proc = dry_run(copy_root, "--configfile", str(f))
    assert proc.returncode == 1 and snakemake_says in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr
    assert "Building DAG of jobs" not in proc.stdout + proc.stderr
