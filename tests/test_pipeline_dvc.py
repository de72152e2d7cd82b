"""The real DAG through `dvc repro` in a fresh copy of the repository, and the comparison with
the `snakemake` build of tests/test_pipeline_integration.py (built once per session, by
whichever test needs it first: repo_copies.shared_build)."""

from __future__ import annotations

import json

import pytest
import yaml
from repo_copies import RECIPES, run

pytestmark = pytest.mark.slow


def _measured(repo) -> set[str]:
    """Each built model's build report: the export times and peak RSS of the build."""
    from recurrent_coreai.pipeline.config import models_to_build

    cfg = yaml.safe_load((repo / "config.yaml").read_text())
    return {f"results/{model}/report/index.html" for model in models_to_build(cfg)}


def _without_report(lock: str, measured: set[str]) -> dict:
    """dvc.lock with the measured reports' digests taken out (everything else must be equal)."""
    stages = yaml.safe_load(lock)["stages"]
    report = [out for name, st in stages.items() if name.startswith("report-") for out in st["outs"]]
    assert sorted(out["path"] for out in report) == sorted(measured)
    for out in report:
        out.pop("md5"), out.pop("size")
    return stages


def test_two_builds_in_two_directories_are_byte_identical(dvc_repo, smk_repo):
    """snakemake in one temp copy, dvc repro in another, fresh processes, other PYTHONHASHSEEDs:
    every file of every output (source, vocab, reference, export, aot, gate, card, publish),
    each tree as its build left it. The build report is the one output that differs: it shows
    the export times and peak RSS measured in that build (one per model: all three tiny families)."""
    (repo, dvc_built), (_, smk_built) = dvc_repo, smk_repo
    measured = _measured(repo)
    assert len(measured) == 3, measured
    assert dvc_built["gates"] == smk_built["gates"]
    ours, theirs = smk_built["outputs"], dvc_built["outputs"]
    assert sorted(ours) == sorted(theirs) and len(ours) > 40
    stages = {rel.split("/")[2] for rel in ours if rel.count("/") >= 3}
    assert {"source", "vocab", "reference", "export", "aot", "gate", "card", "publish"} <= stages, stages
    differing = sorted(rel for rel in ours if ours[rel] != theirs[rel] and rel not in measured)
    assert differing == [], f"{len(differing)} files differ between the two builds: {differing[:8]}"
    assert _without_report(smk_built["dvc_lock"], measured) == _without_report(dvc_built["dvc_lock"], measured)
    assert json.loads((repo / "results/rwkv7-tiny/publish/publish.json").read_text())["gates"].keys() == set(RECIPES)


def test_snakemake_has_nothing_to_do_after_dvc_repro(dvc_repo):
    repo, _ = dvc_repo
    proc = run("snakemake -n --cores 1 publish", repo)
    assert "Nothing to be done" in proc.stdout + proc.stderr
    assert "Data and pipelines are up to date" in run("dvc status", repo).stdout
