"""The real DAG, in temporary copies of the repository: `snakemake --cores 1 publish` of the whole
default DAG (every family; tests/conftest.py ``smk_repo``, the session's one build of it), with
config.yaml as committed (the full gate, what a user builds: the `dvc repro` tree then has only one
model to build). `dvc repro` and the comparison of the two entry points are in
tests/test_pipeline_dvc.py.

The tests that rebuild, push and pull, damage or race on a built tree work on the default model's
DAG alone (``one_model_repo``: config.yaml ``build: [rwkv7-trained]``, its outputs and Snakemake's
record of them the snakemake build's, recorded in DVC by scripts/dvc_record.py): what they check is
what Snakemake and DVC do with one model's jobs, and there each `snakemake`, `dvc status` and DVC
record handles that model's 19 stages, not the whole DAG's 73. The tests that only plan (`snakemake
-n`, `dvc status`) stay on the whole DAG's build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from repo_copies import MODEL, RECIPES, env, run, tracked_outputs

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
GATE_STEPS = yaml.safe_load((ROOT / "config.yaml").read_text())["gate"]["steps"]  # the shared build's


def test_snakemake_builds_everything(smk_repo):
    repo, proc = smk_repo
    res = repo / "results/rwkv7-tiny"
    manifest = json.loads((res / "source/manifest.json").read_text())
    assert manifest["source"]["kind"] == "synthetic" and "model.safetensors" in manifest["files"]
    assert len((res / "vocab/rwkv_vocab.tsv").read_text().splitlines()) == 65529
    for r in RECIPES:
        gate = json.loads((res / f"gate/{r}.json").read_text())
        assert gate["pass"] is True and gate["steps"] == GATE_STEPS
        assert gate["agree_counted"] == gate["counted"]
    receipt = json.loads((res / "publish/publish.json").read_text())
    assert receipt["push"]["pushed"] is False and receipt["push"]["reason"].startswith("staging only")
    assert set(receipt["gates"]) == set(RECIPES)
    assert "staging only" in proc["output"]
    models = yaml.safe_load((repo / "config.yaml").read_text())["models"]
    default = sorted(m for m, v in models.items() if v.get("enabled"))
    assert len(default) >= 4 and all((repo / f"results/{m}/publish/publish.json").is_file() for m in default), default


def test_the_one_model_tree_is_up_to_date_and_recorded(one_model_repo, smk_repo):
    """The tree the next tests change: the whole DAG's stages of the default model (and the
    toolchain), recorded in DVC by `make publish`'s own record (scripts/dvc_record.py, every output
    checked against its stage's record first); nothing to do."""
    repo, made = one_model_repo
    whole = yaml.safe_load((smk_repo[0] / "dvc.yaml").read_text())["stages"]
    n = len(made["stages"])
    assert made["stages"] == sorted(k for k in whole if f"-{MODEL}" in k or k in ("toolchain", "code")) and n > 15, \
        made["stages"]  # "code": the code set files of its stages (pipeline/code_groups.py)
    assert f"DVC: recorded the {n} stage(s) this run built, of {n}" in made["output"], made["output"][-2000:]
    assert "Nothing to be done" in run("snakemake -n --cores 1 publish", repo).stdout
    assert "Data and pipelines are up to date" in run("dvc status", repo).stdout


def test_second_snakemake_run_has_nothing_to_do(smk_repo):
    repo, _ = smk_repo
    proc = run("snakemake -n --cores 1 publish", repo)
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_dvc_status_is_clean_after_snakemake(smk_repo):
    repo, _ = smk_repo
    proc = run("dvc status", repo)
    assert "Data and pipelines are up to date" in proc.stdout, proc.stdout
    assert run("git status --porcelain dvc.yaml", repo).stdout == "", "the run must not rewrite dvc.yaml"


def _planned_rules(repo, extra: str = "") -> set[str]:
    out = run(f"snakemake -n --cores 1 publish {extra}", repo).stdout
    return {line.split()[-1].rstrip(":") for line in out.splitlines() if line.startswith(("rule ", "localrule "))}


def test_a_toolchain_change_rebuilds_exports_and_after_but_not_sources(smk_repo):
    """A new Core AI beta = new pins in requirements.txt (and new installed versions): the
    toolchain stage reruns and with it every export, AOT, gate, card and publish -- nothing else."""
    repo, _ = smk_repo
    req = repo / "requirements.txt"
    text, stat = req.read_text(), req.stat()
    try:
        req.write_text(text.replace("coreai-core==1.0.0b3", "coreai-core==1.0.0b3  # next beta goes here"))
        assert _planned_rules(repo) == {"toolchain", "export", "aot", "gate_shard", "gate", "doctor", "card", "report",
                                        "stage_and_push", "publish"}
    finally:
        req.write_text(text)
        os.utime(req, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert "Nothing to be done" in run("snakemake -n --cores 1 publish", repo).stdout


def test_dvc_push_then_pull_restores_every_artifact_byte_for_byte(one_model_repo):
    """Every output of the default model's DAG (one_model_repo: DVC's whole-tree push and pull
    there, and the realignment after it, handle that model's stages, not the whole DAG's)."""
    repo, _ = one_model_repo
    before = tracked_outputs(repo)
    assert len(before) > 20
    run("dvc push -q", repo)
    assert (repo / "dvc-remote").is_dir()
    shutil.rmtree(repo / "results")
    shutil.rmtree(repo / ".dvc" / "cache")
    run("dvc pull -q", repo)
    assert tracked_outputs(repo) == before
    assert "Data and pipelines are up to date" in run("dvc status", repo).stdout
    # a pull restores file times out of build order: with a clean `dvc status`, realign them
    run("snakemake --cores 1 --touch publish", repo)
    assert "Nothing to be done" in run("snakemake -n --cores 1 publish", repo).stdout


# --- issue 8: only gated bytes are published; DVC records only what a run built, with config.yaml --
def _dvc_changed(repo) -> str:
    return run("dvc status", repo).stdout


def test_naming_config_yaml_explicitly_reruns_nothing(smk_repo):
    repo, _ = smk_repo
    proc = run("snakemake -n --cores 1 publish --configfile config.yaml", repo)
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_a_maintainer_card_is_an_input_of_the_card(smk_repo):
    repo, _ = smk_repo
    cards = repo / "cards"
    cards.mkdir()
    try:
        (cards / f"{MODEL}.md").write_text("Maintained by hand.\n")
        assert _planned_rules(repo) == {"card", "report", "stage_and_push", "publish"}
    finally:
        shutil.rmtree(cards)
    assert "Nothing to be done" in run("snakemake -n --cores 1 publish", repo).stdout


def test_a_bundle_changed_after_its_gate_is_never_staged_nor_recorded(one_model_repo):
    repo, _ = one_model_repo
    mlirb = next((repo / f"results/{MODEL}/export/fp16").glob("*.aimodel/main.mlirb"))
    original, stat, lock = mlirb.read_bytes(), mlirb.stat(), (repo / "dvc.lock").read_text()
    damaged = bytearray(original)
    damaged[4096:6144] = bytes(b ^ 0x5A for b in damaged[4096:6144])  # 2 KB of bit rot
    mlirb.write_bytes(bytes(damaged))
    os.utime(mlirb, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # file times kept
    try:
        proc = run("snakemake --cores 1 --forcerun stage_and_push publish", repo, check=False)
        assert proc.returncode != 0
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        # the export record (sealed, with every file's digest) catches it before the gate's tested files
        assert errors and "main.mlirb" in errors[0] and "differs from what the export stage recorded" in errors[0], \
            proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        assert not (repo / f"results/{MODEL}/publish").exists()
        log = (repo / f"results/logs/{MODEL}/publish.log").read_text()
        assert errors[0] in log, "the error line is in the job's log too"
        assert (repo / "dvc.lock").read_text() == lock, "nothing this run did not build was recorded"
        # `dvc status` trusts mtimes and sizes (kept here); by content (make verify) it shows the change
        status = run('DVC_SITE_CACHE_DIR="$(mktemp -d)" dvc status', repo).stdout
        assert f"export-{MODEL}-fp16:" in status and "modified:" in status, status
    finally:
        mlirb.write_bytes(original)
        os.utime(mlirb, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    run("snakemake --cores 1 publish", repo)
    assert "Data and pipelines are up to date" in _dvc_changed(repo)


def test_a_run_with_another_config_is_not_recorded_as_config_yaml(one_model_repo, tmp_path):
    repo, _ = one_model_repo
    cfg = yaml.safe_load((repo / "config.yaml").read_text())
    cfg["models"][MODEL]["description"] = "Built from another config."
    cfg["build"] = [MODEL]
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    # the description shapes the card and what follows it, nothing else: the path of the effective
    # config file is no param (a run with it once made the next plain run rebuild all jobs)
    card_and_after = {"card", "report", "stage_and_push", "publish"}
    assert _planned_rules(repo, f"--configfile {other}") == card_and_after
    proc = run(f"snakemake --cores 1 publish --configfile {other}", repo)
    assert f"DVC: not recorded: this run's config differs from config.yaml at models.{MODEL}.description" \
        in proc.stderr, proc.stderr[-2000:]
    card = (repo / f"results/{MODEL}/card/README.md").read_text()
    assert "Built from another config." in card
    assert f"card-{MODEL}" in _dvc_changed(repo), "dvc.lock still describes config.yaml's card"
    assert _planned_rules(repo) == card_and_after  # config.yaml's settings again: the card and after only
    run("snakemake --cores 1 publish", repo)  # rebuilt and recorded
    assert "Data and pipelines are up to date" in _dvc_changed(repo)


def test_two_concurrent_runs_in_one_tree_lose_no_record(one_model_repo):
    """Two runs at once whose DAGs share no file Snakemake locks (neither's output is an input of
    any job in the other's DAG: the fp16 gate and the fp32 lowering) both get recorded."""
    repo, _ = one_model_repo
    env_cmd = "snakemake --cores 1 {target} --forcerun {rule}"  # --forcerun takes every word after it
    a = subprocess.Popen(env_cmd.format(rule="gate", target=f"results/{MODEL}/gate/fp16.json"), cwd=repo,
                         shell=True, env=env(PYTHONPATH=str(repo)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    b = subprocess.Popen(env_cmd.format(rule="aot", target=f"results/{MODEL}/aot/universal/fp32"), cwd=repo,
                         shell=True, env=env(PYTHONPATH=str(repo)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        out_a, out_b = a.communicate(timeout=600)[0], b.communicate(timeout=600)[0]
        assert a.returncode == 0 and b.returncode == 0, out_a[-2000:] + out_b[-2000:]
        # each run records what it built, and what the other finished meanwhile (outputs newer than its start)
        assert "DVC: recorded the " in out_a and "DVC: recorded the " in out_b, out_a[-2000:] + out_b[-2000:]
        status = run(f"dvc status gate-{MODEL}-fp16 aot-{MODEL}-universal-fp32", repo).stdout
        assert "changed outs" not in status, status
    finally:  # the lowering is newer than its gate: bring the rest up to date (the next tests need it)
        run("snakemake --cores 1 publish", repo)
    assert "Data and pipelines are up to date" in _dvc_changed(repo)


# --- issue 9: each stage reruns when the code it runs changes, and only then ------------------------
def _downstream(jobs: list[dict], rule: str) -> set[str]:
    """Rules whose jobs consume (transitively) the outputs of ``rule``'s jobs."""
    produced, found, grew = {o for j in jobs if j["rule"] == rule for o in j["outs"]}, {rule}, True
    while grew:
        grew = False
        for j in jobs:
            if j["rule"] not in found and set(j["deps"]) & produced:
                found.add(j["rule"])
                produced |= set(j["outs"])
                grew = True
    return found


def _edited(path: Path):
    """Append a comment to a file; restore bytes and times afterwards."""
    import contextlib

    @contextlib.contextmanager
    def edit():
        text, stat = path.read_text(), path.stat()
        path.write_text(text + ("\n{# edited #}\n" if path.suffix == ".j2" else "\n# edited\n"))
        try:
            yield
        finally:
            path.write_text(text)
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    return edit()


def _code_groups_written(repo: Path):
    """The `code` stage's command run in ``repo`` (pipeline/code_groups.py: one md5 list per code set);
    the group files and their times restored afterwards."""
    import contextlib

    @contextlib.contextmanager
    def written():
        stage = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]["code"]
        kept = {p: (p.read_bytes(), p.stat()) for p in (repo / o for o in stage["outs"])}
        run(stage["cmd"], repo)
        try:
            yield
        finally:
            for p, (data, st) in kept.items():
                p.write_bytes(data)
                os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    return written()


def _dvc_changed_stages(repo) -> set[str]:
    out = run("dvc status", repo).stdout
    return {line.rstrip(":").split("-")[0] for line in out.splitlines() if line and not line.startswith(("\t", " "))}


@pytest.fixture(scope="module")
def one_model_jobs(one_model_repo) -> list[dict]:
    """The one-model tree's DAG jobs (the same for every edit below: each test puts the file back)."""
    from recurrent_coreai.pipeline import dag

    return dag.snakemake_jobs(one_model_repo[0])


# End to end through Snakemake and DVC for a sample (tests/test_dag_drift.py checks every stage's
# fingerprint in process: its own script and modules in, the other stages' out). A family's folder
# is in the fingerprint of every stage that runs family code (fingerprint.FAMILY_RULES), for that
# family's models only.
FAMILY_RULES = ("source", "vocab", "reference", "export", "doctor", "card", "stage_and_push")


@pytest.mark.parametrize("edit, rules", [
    *[(f"scripts/{s}.py", (r,)) for s, r in [("source", "source"), ("gate", "gate"), ("publish", "stage_and_push")]],
    ("recurrent_coreai/stages/templates/model_card.md.j2", ("card",)),
    ("recurrent_coreai/families/rwkv7/reference.py", FAMILY_RULES),
    ("recurrent_coreai/coreai/quantize.py", ("export",)),
])
def test_a_code_change_reruns_exactly_the_stages_that_run_it(one_model_repo, one_model_jobs, edit, rules):
    from recurrent_coreai.pipeline import fingerprint

    assert set(FAMILY_RULES) == fingerprint.FAMILY_RULES
    repo, _ = one_model_repo
    jobs = one_model_jobs
    with _edited(repo / edit):
        planned = _planned_rules(repo)
        only_code = _dvc_changed_stages(repo)  # DVC sees the edit in the `code` stage's deps, no further yet
        with _code_groups_written(repo):  # what `dvc repro` runs first: the code set files again
            changed = _dvc_changed_stages(repo) - {"code"}
    assert only_code == {"code"}, f"editing {edit}: dvc status lists {sorted(only_code)} before the code stage ran"
    expected = set().union(*(_downstream(jobs, r) for r in rules)) | {"publish"}
    if edit.endswith(".j2"):  # the card template is read by card and by publish (which merges cards)
        expected |= {"stage_and_push"}
    assert planned == expected, f"editing {edit}: Snakemake plans {sorted(planned)}"
    # ... and the publish stage, whose provenance attests the code of every stage (fingerprint.ATTESTED)
    direct = set(rules) | {"stage_and_push"}
    assert changed == direct, f"editing {edit}: dvc status lists {sorted(changed)}"
    assert "Nothing to be done" in run("snakemake -n --cores 1 publish", repo).stdout
