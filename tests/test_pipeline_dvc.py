"""The real DAG through `dvc repro` in a fresh copy of the repository, and the comparison with
the `snakemake` build of tests/test_pipeline_integration.py (built once per session, by
whichever test needs it first: repo_copies.shared_build)."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from repo_copies import RECIPES, run

pytestmark = pytest.mark.slow


# The CPU capability torch reported where the committed dvc.lock was recorded (bench/bench_dag.py on
# this project's 2-core machine, where CI runs): the Core AI runtime and torch pick their CPU kernels
# by it, so the gate's numbers differ in their last bits on another (measured 2026-12-02: an AVX2 build
# of the AVX512 record matched every source, vocab, reference, export and aot output; every gate JSON,
# and so card, report and publish, differed). Re-record dvc.lock elsewhere: update this too.
RECORDED_CPU_CAPABILITY = "AVX2"
# the outputs that do not depend on the gate's settings (the tests' Snakemake build has the short gate)
GATE_FREE = ("source", "vocab", "export", "aot")


def _lock(text: str) -> dict:
    return yaml.safe_load(text)["stages"]


def _differences(ours: dict, theirs: dict) -> list[str]:
    """Stages (and what in them) that differ between two dvc.lock files."""
    out = [f"{name}: only in the committed dvc.lock" for name in sorted(set(ours) - set(theirs))]
    out += [f"{name}: only in the fresh build's dvc.lock" for name in sorted(set(theirs) - set(ours))]
    for name in sorted(set(ours) & set(theirs)):
        for key in ("cmd", "params", "deps", "outs"):
            if ours[name].get(key) != theirs[name].get(key):
                a = {d["path"]: d for d in ours[name].get(key) or []} if key in ("deps", "outs") else None
                b = {d["path"]: d for d in theirs[name].get(key) or []} if key in ("deps", "outs") else None
                paths = sorted(p for p in set(a) | set(b) if a.get(p) != b.get(p)) if a is not None else []
                out.append(f"{name}: {key} differ{(' at ' + ', '.join(paths[:3])) if paths else ''}")
    return out


def _cpu_independent(committed: dict, fresh: dict) -> tuple[dict, dict]:
    """Both records whole on a CPU of the recorded capability. On another, only the stages whose
    outputs no runtime number shapes (not the gate and what follows it), said in a warning; in CI
    (CI=true) that is a failure: CI runs on the machine dvc.lock is recorded for, and a user there
    would see dvc.lock modified after `make publish`."""
    import warnings

    import torch

    here = torch.backends.cpu.get_cpu_capability()
    if here == RECORDED_CPU_CAPABILITY:
        return committed, fresh
    message = (f"this CPU runs {here} kernels, dvc.lock was recorded with {RECORDED_CPU_CAPABILITY}: the gate's "
               "numbers differ in their last bits, so only the stages before the gate were compared")
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message} -- fix: re-record dvc.lock on this machine (python bench/bench_dag.py, then copy "
                    "its dvc.lock) and set RECORDED_CPU_CAPABILITY in tests/test_pipeline_dvc.py")
    warnings.warn(message)
    after_gate = ("gate-", "card-", "report-", "stage_and_push-")
    keep = lambda lock: {k: v for k, v in lock.items() if not k.startswith(after_gate)}  # noqa: E731
    return keep(committed), keep(fresh)


def test_the_make_publish_record_of_a_build_is_the_committed_dvc_lock(dvc_repo, repo_root):
    """`make publish` records its build in DVC from Snakemake's onsuccess hook (scripts/dvc_record.py:
    `dvc commit -f dvc.yaml` for a full build), not by `dvc repro`: that record of the same outputs,
    made from scratch (no dvc.lock), is the committed dvc.lock too."""
    repo, built = dvc_repo
    lock = repo / "dvc.lock"
    kept = lock.read_bytes()
    try:
        lock.unlink()
        proc = run("python scripts/dvc_record.py --config-file config.yaml --since 0", repo)
        assert "DVC: recorded" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        committed, fresh = _cpu_independent(_lock((repo_root / "dvc.lock").read_text()), _lock(lock.read_text()))
    finally:
        lock.write_bytes(kept)
    differences = _differences(committed, fresh)
    assert differences == [], f"make publish's record differs from the committed dvc.lock: {differences[:6]}"


def test_two_builds_in_two_directories_are_byte_identical(dvc_repo, smk_repo):
    """snakemake in one temp copy, dvc repro in another, fresh processes, other PYTHONHASHSEEDs:
    every file of every output that does not depend on the gate's settings (source, vocab, export,
    aot: the bundles) is the same. The gate, card, report and publish outputs of the full-gate
    build are compared with the committed dvc.lock below (recorded by a Snakemake build)."""
    (repo, dvc_built), (_, smk_built) = dvc_repo, smk_repo
    ours, theirs = smk_built["outputs"], dvc_built["outputs"]
    assert sorted(ours) == sorted(theirs) and len(ours) > 40
    free = sorted(rel for rel in ours if rel.count("/") >= 3 and rel.split("/")[2] in GATE_FREE)
    assert {rel.split("/")[2] for rel in free} == set(GATE_FREE) and len(free) > 30, free
    assert all(rel.split("/")[1] in {"rwkv7-tiny", "rwkv6-tiny", "mamba2-tiny"} for rel in free)
    differing = [rel for rel in free if ours[rel] != theirs[rel]]
    assert differing == [], f"{len(differing)} files differ between the two builds: {differing[:8]}"
    assert json.loads((repo / "results/rwkv7-tiny/publish/publish.json").read_text())["gates"].keys() == set(RECIPES)


def test_the_committed_dvc_lock_is_what_a_fresh_build_records(dvc_repo, repo_root):
    """`dvc repro` of a fresh copy (config.yaml as committed) writes exactly the committed dvc.lock:
    every stage, its command, params, code and data deps and every output's digest -- so a fresh
    clone's `make publish` leaves `git status` clean. dvc.lock describes a build on the toolchain
    its toolchain stage recorded; on another one (python and the package versions) the whole DAG
    rebuilds by design, and this comparison says so instead of listing every stage."""
    repo, built = dvc_repo
    committed, fresh = _lock((repo_root / "dvc.lock").read_text()), _lock(built["dvc_lock"])
    committed, fresh = _cpu_independent(committed, fresh)
    ours, theirs = committed.get("toolchain", {}), fresh.get("toolchain", {})
    if ours.get("deps") == theirs.get("deps") and ours.get("outs") != theirs.get("outs"):
        # the same toolchain code recorded another toolchain.json: this machine's python, torch,
        # coreai or OS is not the one dvc.lock was recorded on (a stale dvc.lock differs in deps too)
        why = ("this machine's toolchain (results/toolchain.json: python and the package versions) is not the "
               "one dvc.lock was recorded with")
        if os.environ.get("CI") == "true":  # CI installs the pinned toolchain on the machine dvc.lock is recorded for
            pytest.fail(f"{why} -- fix: re-record dvc.lock with this toolchain (python bench/bench_dag.py)")
        pytest.skip(f"{why}; compare on that toolchain, or rebuild and commit dvc.lock")
    differences = _differences(committed, fresh)
    assert differences == [], (f"the committed dvc.lock is not what a fresh build records ({len(differences)}: "
                               f"{differences[:6]}) -- fix: commit the code, run `make publish`, commit dvc.lock")
    assert built["git_status"] == "", f"the build left the copy's git tree changed:\n{built['git_status']}"


def test_snakemake_has_nothing_to_do_after_dvc_repro(dvc_repo):
    repo, _ = dvc_repo
    proc = run("snakemake -n --cores 1 publish", repo)
    assert "Nothing to be done" in proc.stdout + proc.stderr
    assert "Data and pipelines are up to date" in run("dvc status", repo).stdout
