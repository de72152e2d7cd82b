"""Bad config values in ``config.yaml`` itself, run as a user runs them: ``snakemake -n --cores 1
publish`` and ``dvc repro`` in a fresh copy of the repository (docs/bad-inputs.md, rows 89-90).

* NaN thresholds: Snakemake stops before planning with our one line; ``dvc repro`` reads
  config.yaml only for the stages' params, so the first stage it runs validates the config and
  prints the same line, then DVC adds its own ``ERROR: failed to reproduce ...`` line (exit 255).
* A duplicate key: Snakemake stops with our one line naming both lines; ``dvc repro`` refuses
  the file itself while reading params (ruamel.yaml's duplicate-key error, several lines): no
  stage of ours runs, so that message is DVC's. If this test fails there, DVC changed.

The copy's config.yaml (as committed) is rewritten per test; nothing here builds a result."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from repo_copies import fresh_copy, run

NAN_LINE = ("error: config.yaml: gate/thresholds/fp16/min_agree is .nan, not a finite number (NaN and infinities "
            "pass every range check, so a check set to one is silently off) -- fix: min_agree cannot be switched "
            "off: write a number in 0..1, the share of decode steps (outside near-ties) whose top-1 token must "
            "agree; 0 accepts any agreement")


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = fresh_copy(tmp_path_factory.mktemp("integrity") / "repo", short=False)  # config.yaml as committed
    (root / "config.committed.yaml").write_text((root / "config.yaml").read_text())
    return root


def stderr_lines(proc) -> list[str]:
    """stderr less Snakemake's notice about the workflow profile."""
    return [line for line in proc.stderr.splitlines() if not line.startswith("Using workflow specific profile")]


def set_config(repo: Path, text: str) -> None:
    (repo / "config.yaml").write_text(text)
    for gone in ("results", ".snakemake"):
        run(f"rm -rf {gone}", repo)


def nan_config(repo: Path) -> str:
    cfg = yaml.safe_load((repo / "config.committed.yaml").read_text())
    cfg["gate"]["thresholds"]["fp16"].update(min_agree=math.nan, max_abs_dlogits=math.nan)
    text = yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True)
    assert "min_agree: .nan" in text and "max_abs_dlogits: .nan" in text
    return text


def duplicate_key_config(repo: Path) -> str:
    """A second `steps:` right after `gate:` (the block already sets `steps: 127`)."""
    lines = (repo / "config.committed.yaml").read_text().splitlines(keepends=True)
    at = lines.index("gate:\n")
    return "".join(lines[: at + 1] + ["  steps: 40\n"] + lines[at + 1:])


def test_nan_thresholds_in_config_yaml_stop_snakemake_before_any_job(repo):
    set_config(repo, nan_config(repo))
    proc = run("snakemake -n --cores 1 publish", repo, check=False)
    assert proc.returncode == 1 and stderr_lines(proc) == [NAN_LINE], proc.stdout[-1500:] + proc.stderr[-3000:]
    assert "Building DAG of jobs" not in proc.stdout + proc.stderr
    assert not (repo / "results").exists()


def test_nan_thresholds_in_config_yaml_stop_dvc_repro_at_its_first_stage(repo):
    """DVC reads config.yaml for the stages' params only; the first stage it runs validates the
    whole config: our line first, then DVC's own line naming that stage; nothing recorded."""
    set_config(repo, nan_config(repo))
    lock = (repo / "dvc.lock").read_text()
    proc = run("dvc repro", repo, check=False)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 255 and len(lines) == 2, proc.stdout[-1500:] + proc.stderr[-3000:]
    assert lines[0] == NAN_LINE
    assert lines[1].startswith("ERROR: failed to reproduce '") and lines[1].endswith("exited with 1"), lines[1]
    # the first stage `dvc repro` runs is `code` (its outs are the code set files every other stage
    # depends on: pipeline/code_groups.py); it validates the config before it writes anything
    assert lines[1].split("'")[1] == "code", lines[1]
    left = sorted(str(p.relative_to(repo)) for p in repo.glob("results/**/*") if p.is_file())
    assert left == [], left  # no output, no temporary
    assert (repo / "dvc.lock").read_text() == lock


def test_a_duplicate_key_in_config_yaml_stops_snakemake_with_both_lines(repo):
    text = duplicate_key_config(repo)
    first = text.splitlines().index("  steps: 40") + 1
    second = text.splitlines().index("  steps: 127") + 1
    set_config(repo, text)
    proc = run("snakemake -n --cores 1 publish", repo, check=False)
    assert proc.returncode == 1 and stderr_lines(proc) == [
        f"error: config.yaml: duplicate key gate/steps at lines {first} and {second} (YAML silently keeps the last "
        "one) -- fix: keep one of the two"], proc.stdout[-1500:] + proc.stderr[-3000:]


def test_a_duplicate_key_in_config_yaml_is_refused_by_dvc_itself(repo):
    """DVC reads config.yaml (the params file) with ruamel.yaml, which refuses duplicate keys
    before any stage runs: DVC's message (several lines), not ours; exit 255, nothing written."""
    text = duplicate_key_config(repo)
    set_config(repo, text)
    lock = (repo / "dvc.lock").read_text()
    proc = run("dvc repro", repo, check=False)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 255 and lines, proc.stdout[-1500:] + proc.stderr[-3000:]
    assert lines[0].startswith("ERROR: failed to reproduce '"), lines[0]
    assert lines[0].endswith(": Unable to read parameters from 'config.yaml': unable to read: 'config.yaml', YAML "
                             "file structure is corrupted: while constructing a mapping"), lines[0]
    assert 'found duplicate key "steps" with value "127" (original value: "40")' in proc.stderr
    assert "Running stage" not in proc.stdout and not (repo / "results").exists()
    assert (repo / "dvc.lock").read_text() == lock


def with_models(repo: Path, *names: str) -> str:
    cfg = yaml.safe_load((repo / "config.committed.yaml").read_text())
    for name in names:
        cfg["models"][name] = cfg["models"]["rwkv7-tiny"]
    cfg["build"] = list(names)
    return yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True)


def test_a_model_named_logs_in_config_yaml_stops_snakemake_and_source_alone_is_fine(repo):
    """`logs` (here beside `source`, whose logs would go to results/logs/source/) is taken by the
    results layout; `source` alone is not: its outputs go to results/source/, which nothing else uses."""
    set_config(repo, with_models(repo, "logs", "source"))
    proc = run("snakemake -n --cores 1 publish", repo, check=False)
    assert proc.returncode == 1 and stderr_lines(proc) == [
        "error: config.yaml: models/logs: the name is taken: results/logs/ holds every model's job logs, and this "
        "model's outputs would go to results/logs/ -- fix: rename the model (names the results layout uses: logs, "
        "toolchain.json, and toolchain.log for the logs; compared ignoring case)"], proc.stdout[-1500:] + proc.stderr
    set_config(repo, with_models(repo, "source"))
    proc = run("snakemake -n --cores 1 publish", repo, check=False)
    assert proc.returncode == 0 and stderr_lines(proc) == [], proc.stdout[-1500:] + proc.stderr[-3000:]
    assert "results/source/export/fp16" in proc.stdout, proc.stdout[-1500:]
