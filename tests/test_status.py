"""`python -m recurrent_coreai status`: rows from the records a build leaves, staleness against the
installed toolchain and against the code dvc.lock recorded -- fast, and without torch."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from recurrent_coreai.pipeline import fingerprint
from recurrent_coreai.tools import status
from recurrent_coreai.coreai import toolchain
from recurrent_coreai.pipeline.dag import stage_name
from recurrent_coreai.pipeline.paths import Layout

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def dvc_lock(root: Path, model: str, recipes: list[str]) -> str:
    """dvc.lock as `dvc commit` writes it for the default DAG, its md5s hashed by DVC's own code."""
    from dvc_data.hashfile.hash import file_md5

    family = yaml.safe_load((root / "config.yaml").read_text())["models"][model]["family"]

    def code_deps(rule):  # a model's stages also depend on its family's folder (as dag.render writes them)
        return [{"path": rel, "hash": "md5", "md5": file_md5(str(root / rel)), "size": (root / rel).stat().st_size}
                for rel in fingerprint.code_files(rule, None if rule == "toolchain" else family)]

    jobs = [("toolchain", {})] + [(r, {"model": model}) for r in status.MODEL_STAGES]
    jobs += [(rule, {"model": model, **({"target": "universal"} if rule == "aot" else {}), "recipe": recipe})
             for recipe in recipes for rule in ("export", "aot", "gate", "doctor")]
    stages = {stage_name({"rule": rule, "wildcards": w}): {"cmd": f"python scripts/{rule}.py", "deps": code_deps(rule)}
              for rule, w in jobs}
    return yaml.safe_dump({"schema": "2.0", "stages": stages}, sort_keys=False)


@pytest.fixture
def tree(tmp_path, repo_root, monkeypatch):
    """A repository root with the code, config.yaml, dvc.lock and the records of a build of
    rwkv7-tiny: fp32 gated and published, fp16 failed its gate, int8keepproj not built."""
    root = tmp_path / "repo"
    for sub in ("scripts", "recurrent_coreai"):
        shutil.copytree(repo_root / sub, root / sub, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(repo_root / "config.yaml", root / "config.yaml")
    cfg = yaml.safe_load((root / "config.yaml").read_text())
    cfg["build"] = ["rwkv7-tiny"]  # the rows of this one model (the other families' tiny models are built too)
    (root / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    model, lay = "rwkv7-tiny", Layout(root / "results", "rwkv7-tiny")
    recipes = cfg["models"][model]["recipes"]
    assert recipes == ["fp32", "fp16", "int8keepproj"]

    def put(path: Path, record: dict):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))

    put(lay.toolchain, toolchain.record())
    for recipe, size in (("fp32", 68_878_459), ("fp16", 34_458_096)):
        put(lay.export(recipe) / "export.json", {"recipe": recipe, "size_bytes": size})
    put(lay.gate_json("fp32"), {"recipe": "fp32", "pass": True, "agree_counted": 40, "counted": 40,
                                "max_abs_dlogits": 2.29e-05})
    put(lay.gate_json("fp16").with_suffix(".failed.json"), {"recipe": "fp16", "pass": False, "agree_counted": 31,
                                                             "counted": 40, "max_abs_dlogits": 1.5})
    put(lay.publish / "publish.json", {"gates": {"fp32": {"pass": True}}, "push": {"pushed": True, "commit": COMMIT}})
    (root / "dvc.lock").write_text(dvc_lock(root, model, recipes))
    monkeypatch.chdir(root)
    return root


def table(root: Path) -> dict[str, dict[str, str]]:
    from recurrent_coreai.pipeline import config

    found = status.survey(config.load(root / "config.yaml"), root)
    assert found.problems == []
    return {r["recipe"]: r for r in found.rows}


def test_a_built_tree_shows_built_gated_and_published(tree):
    rows = table(tree)
    assert rows["fp32"] == {"model": "rwkv7-tiny", "recipe": "fp32", "built": "yes (68.9 MB)", "gate": "pass",
                            "top-1": "40/40", "max|dlogits|": "2.29e-05", "published": COMMIT, "stale": "no"}
    assert (rows["fp16"]["built"], rows["fp16"]["gate"], rows["fp16"]["top-1"]) == ("yes (34.5 MB)", "FAIL", "31/40")
    assert rows["fp16"]["published"] == "no" and rows["fp16"]["stale"] == "no"
    assert (rows["int8keepproj"]["built"], rows["int8keepproj"]["gate"]) == ("no", "-")
    assert rows["int8keepproj"]["published"] == "no" and rows["int8keepproj"]["stale"] == "-"


def test_a_staged_receipt_without_a_push_reads_staged(tree):
    receipt = tree / "results/rwkv7-tiny/publish/publish.json"
    receipt.write_text(json.dumps({"gates": {"fp32": {}}, "push": {"pushed": False, "reason": "staging only: …"}}))
    assert table(tree)["fp32"]["published"] == "staged"


def test_a_toolchain_change_marks_every_built_row_stale(tree):
    record = json.loads((tree / "results/toolchain.json").read_text())
    record["versions"]["coreai-core"] = "1.0.0b2"  # built with the previous beta
    (tree / "results/toolchain.json").write_text(json.dumps(record))
    installed = toolchain.versions()["coreai-core"]
    rows = table(tree)
    assert rows["fp32"]["stale"] == f"toolchain (coreai-core 1.0.0b2->{installed})"
    assert rows["fp16"]["stale"].startswith("toolchain") and rows["int8keepproj"]["stale"] == "-"


@pytest.mark.parametrize("edit, rules", [
    ("recurrent_coreai/coreai/quantize.py", "export"),
    ("recurrent_coreai/stages/templates/model_card.md.j2", "card, stage_and_push"),  # publish merges cards
    ("scripts/gate.py", "gate"),
    # the model's family: every stage that runs family code (fingerprint.FAMILY_RULES)
    ("recurrent_coreai/families/rwkv7/reference.py", "card, doctor, export, reference, source, stage_and_push, vocab"),
    ("recurrent_coreai/util/errors.py", None),  # every stage imports it: every stage of the row
])
def test_a_code_edit_marks_the_stages_that_run_it(tree, edit, rules):
    every = ", ".join(sorted({"toolchain", *status.MODEL_STAGES, "export", "aot", "gate", "doctor"}))
    with open(tree / edit, "a") as fh:
        fh.write("\n# edited\n")
    assert {r["stale"] for r in table(tree).values() if r["built"] != "no"} == {f"code: {rules or every}"}


def test_stages_missing_from_dvc_lock_and_a_missing_lock_are_said(tree):
    lock = yaml.safe_load((tree / "dvc.lock").read_text())
    del lock["stages"]["gate-rwkv7-tiny-fp32"]
    (tree / "dvc.lock").write_text(yaml.safe_dump(lock))
    rows = table(tree)
    assert rows["fp32"]["stale"] == "not in dvc.lock: gate" and rows["fp16"]["stale"] == "no"
    (tree / "dvc.lock").unlink()
    assert table(tree)["fp32"]["stale"] == "unknown: no dvc.lock"


def test_the_command_prints_the_table_fast_and_without_torch(tree):
    code = ("import sys; from recurrent_coreai.tools import status; rc = status.main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules and 'snakemake' not in sys.modules, 'status imported torch/snakemake'; "
            "sys.exit(rc)")
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, "--root", str(tree)], cwd=tree, capture_output=True, text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["model", "recipe", "built", "gate", "top-1", "max|dlogits|", "published", "stale"]
    assert lines[1].split() == ["rwkv7-tiny", "fp32", "yes", "(68.9", "MB)", "pass", "40/40", "2.29e-05", COMMIT, "no"]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"status: {wall:.2f} s wall, {cpu:.2f} s CPU")
    assert cpu < 2.0, f"status took {cpu:.2f} s of CPU ({wall:.2f} s wall)"


def test_a_broken_config_is_one_line(tree):
    (tree / "config.yaml").write_text("results: [")
    proc = subprocess.run([sys.executable, "-c", "import sys; from recurrent_coreai.tools import status; sys.exit(status.main([]))"],
                          cwd=tree, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.startswith("error: config.yaml: invalid YAML"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1


def test_the_rows_of_a_real_build(tiny_results, repo_root, cfg):
    """The session's real tree (stage entry points, real gates): every recipe built, gated, staged."""
    conf = {**cfg, "results": str(tiny_results)}
    found = status.survey(conf, repo_root)
    assert found.problems == []
    rows = {r["recipe"]: r for r in found.rows}
    for recipe in cfg["models"]["rwkv7-tiny"]["recipes"]:
        gate = json.loads(Layout(tiny_results, "rwkv7-tiny").gate_json(recipe).read_text())
        assert rows[recipe]["built"].startswith("yes") and rows[recipe]["gate"] == "pass"
        assert rows[recipe]["top-1"] == f"{gate['agree_counted']}/{gate['counted']}"
        assert float(rows[recipe]["max|dlogits|"]) == pytest.approx(gate["max_abs_dlogits"], rel=1e-2)
        assert rows[recipe]["published"] == "staged"
