"""`python -m recurrent_coreai status`: rows from the records a build leaves, staleness against the
installed toolchain and against the code dvc.lock recorded, for the stages that dvc.yaml (the job
listing) puts behind each row -- fast, and without torch."""

from __future__ import annotations

import functools
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from recurrent_coreai.pipeline import code_groups
from recurrent_coreai.tools import status
from recurrent_coreai.coreai import toolchain
from recurrent_coreai.pipeline.paths import Layout

COMMIT = "0123456789abcdef0123456789abcdef01234567"
# what a row's freshness means (the rules of its stages): the stages its export flows through to
# the published bundle, and everything before them -- not the report page
ROW_RULES = ("aot", "card", "doctor", "export", "gate", "gate_shard", "reference", "source", "stage_and_push", "toolchain",
             "vocab")


def dvc_lock(root: Path) -> str:
    """dvc.lock as `dvc commit` writes it for every stage of the tree's dvc.yaml (its code deps,
    hashed by DVC's own code)."""
    import hashlib

    from dvc_data.hashfile.hash import file_md5

    md5s = {}

    def dep(rel):
        if rel not in md5s:
            if status.is_group_file(rel):  # a code set's file (pipeline/code_groups.py) as the `code` stage writes it
                data = code_groups.text(Path(rel).name.removesuffix(code_groups.SUFFIX), root).encode()
                md5s[rel] = {"path": rel, "hash": "md5", "md5": hashlib.md5(data).hexdigest(), "size": len(data)}
            else:
                md5s[rel] = {"path": rel, "hash": "md5", "md5": file_md5(str(root / rel)), "size": (root / rel).stat().st_size}
        return dict(md5s[rel])  # a copy: shared dicts would be dumped as YAML aliases

    stages = yaml.load((root / "dvc.yaml").read_text(), Loader=yaml.CSafeLoader)["stages"]  # libyaml: ~1 s less a test
    lock = {name: {"cmd": st["cmd"], "deps": [dep(rel) for rel in st.get("deps", [])
                                              if rel.startswith(status.CODE_DIRS) or status.is_group_file(rel)]}
            for name, st in stages.items()}
    return yaml.dump({"schema": "2.0", "stages": lock}, Dumper=yaml.CSafeDumper, sort_keys=False)


@functools.cache
def pristine_lock(repo_root: Path) -> str:
    """:func:`dvc_lock` of the checkout's own code and dvc.yaml, once a session: every ``tree``
    copies both unchanged (hashing the code and dumping ~880 KB took ~0.25 s a test, ~145 tests)."""
    return dvc_lock(repo_root)


@pytest.fixture
def tree(tmp_path, repo_root, monkeypatch):
    """A repository root with the code, config.yaml, dvc.yaml, dvc.lock and the records of a build
    of rwkv7-tiny: fp32 gated and published, fp16 failed its gate, int8keepproj not built."""
    root = tmp_path / "repo"
    for sub in ("scripts", "recurrent_coreai"):
        shutil.copytree(repo_root / sub, root / sub, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("config.yaml", "dvc.yaml"):
        shutil.copy(repo_root / name, root / name)
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
    (root / "dvc.lock").write_text(pristine_lock(repo_root))
    code = yaml.load((root / "dvc.yaml").read_text(), Loader=yaml.CSafeLoader)["stages"][code_groups.STAGE]["outs"]
    code_groups.write(root / "results" / code_groups.FOLDER, [Path(o).name.removesuffix(code_groups.SUFFIX) for o in code],
                      root)
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


@pytest.mark.parametrize("edit, rules", [  # publish attests every stage's code (provenance): it is stale too
    ("recurrent_coreai/coreai/quantize.py", "export, stage_and_push"),
    ("recurrent_coreai/stages/templates/model_card.md.j2", "card, stage_and_push"),  # publish merges cards
    ("scripts/gate.py", "gate, stage_and_push"),
    # the model's family: every stage that runs family code (fingerprint.FAMILY_RULES)
    ("recurrent_coreai/families/rwkv7/reference.py", "card, doctor, export, reference, source, stage_and_push, vocab"),
    ("recurrent_coreai/util/errors.py", None),  # every stage imports it: every stage of the row
])
def test_a_code_edit_marks_the_stages_that_run_it(tree, edit, rules):
    with open(tree / edit, "a") as fh:
        fh.write("\n# edited\n")
    assert {r["stale"] for r in table(tree).values() if r["built"] != "no"} == {f"code: {rules or ', '.join(ROW_RULES)}"}


def test_the_report_page_is_not_part_of_a_rows_freshness(tree):
    """report-<model> reads every gate and the card, but the published bundle does not read it."""
    with open(tree / "scripts/report.py", "a") as fh:
        fh.write("\n# edited\n")
    assert [r["stale"] for r in table(tree).values()] == ["no", "no", "-"]


def listing(root: Path) -> dict:
    return yaml.safe_load((root / "dvc.yaml").read_text())


def test_a_rows_stages_are_found_in_dvc_yaml(tree):
    """Exactly the row's: its own export/aot/gate (and its shard)/doctor, the model's shared stages, the toolchain --
    none of another recipe's or another model's, not the report."""
    from recurrent_coreai.pipeline import dag

    graph = dag.read_listing(tree / "dvc.yaml")
    lay = Layout("results", "rwkv7-tiny")
    got = status.row_stages(graph, str(lay.export("fp32")), str(lay.gate_json("fp32")), str(lay.publish))
    aots = {n for n in listing(tree)["stages"] if n.startswith("aot-rwkv7-tiny-") and n.endswith("-fp32")}
    assert aots and got == aots | {"toolchain", "source-rwkv7-tiny", "vocab-rwkv7-tiny", "reference-rwkv7-tiny",
                                   "export-rwkv7-tiny-fp32", "gate-rwkv7-tiny-fp32", "gate_shard-rwkv7-tiny-fp32-0",
                                   "doctor-rwkv7-tiny-fp32",
                                   "card-rwkv7-tiny", "stage_and_push-rwkv7-tiny",
                                   "code"}  # it writes the code set files the row's stages depend on
    assert status.row_stages(graph, "results/rwkv7-tiny/export/int8", str(lay.gate_json("int8")), str(lay.publish)) is None


def test_a_stage_recorded_with_other_code_for_one_recipe_marks_that_row_only(tree):
    """dvc.lock says export-rwkv7-tiny-fp16 ran other code: the fp16 row is stale, fp32 is not;
    the card (shared by the model's recipes) marks both."""
    lock = yaml.safe_load((tree / "dvc.lock").read_text())
    lock["stages"]["export-rwkv7-tiny-fp16"]["deps"][0]["md5"] = "0" * 32
    (tree / "dvc.lock").write_text(yaml.safe_dump(lock))
    rows = table(tree)
    assert (rows["fp32"]["stale"], rows["fp16"]["stale"]) == ("no", "code: export")
    lock["stages"]["card-rwkv7-tiny"]["deps"][0]["md5"] = "0" * 32
    (tree / "dvc.lock").write_text(yaml.safe_dump(lock))
    rows = table(tree)
    assert (rows["fp32"]["stale"], rows["fp16"]["stale"]) == ("code: card", "code: card, export")


def test_a_stage_dvc_yaml_adds_before_or_between_is_part_of_the_row(tree):
    """A new stage in dvc.yaml: calibrate (before fp32's export) and lint (reads a file inside
    fp32's export directory; publish reads its output). Editing their code marks the fp32 row
    only; a stage dvc.lock has not recorded yet says so."""
    stages = listing(tree)["stages"]
    (tree / "scripts/calibrate.py").write_text("print('calibrate')\n")
    (tree / "scripts/lint.py").write_text("print('lint')\n")
    stages["calibrate-rwkv7-tiny"] = {"cmd": "python scripts/calibrate.py", "outs": ["results/rwkv7-tiny/calib"],
                                      "deps": ["results/rwkv7-tiny/source", "scripts/calibrate.py"]}
    stages["export-rwkv7-tiny-fp32"]["deps"].append("results/rwkv7-tiny/calib")
    stages["lint-rwkv7-tiny-fp32"] = {"cmd": "python scripts/lint.py", "outs": ["results/rwkv7-tiny/lint/fp32.json"],
                                      "deps": ["results/rwkv7-tiny/export/fp32/model.aimodel", "scripts/lint.py"]}
    stages["stage_and_push-rwkv7-tiny"]["deps"].append("results/rwkv7-tiny/lint/fp32.json")
    (tree / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    assert {r["stale"] for r in table(tree).values()} == {"not in dvc.lock: calibrate, lint", "no", "-"}
    assert table(tree)["fp32"]["stale"] == "not in dvc.lock: calibrate, lint"
    (tree / "dvc.lock").write_text(dvc_lock(tree))
    assert [r["stale"] for r in table(tree).values()] == ["no", "no", "-"]
    for script, rule in (("calibrate", "calibrate"), ("lint", "calibrate, lint")):
        with open(tree / f"scripts/{script}.py", "a") as fh:
            fh.write("# edited\n")
        rows = table(tree)
        assert (rows["fp32"]["stale"], rows["fp16"]["stale"]) == (f"code: {rule}", "no")


def test_a_model_dvc_yaml_has_no_stages_for(tree):
    """A built recipe without stages in dvc.yaml (generated before the recipe was added): its row
    says so, one line names dvc.yaml and the fix; a model only another config builds says so
    without an error."""
    from recurrent_coreai.pipeline import config

    stages = listing(tree)["stages"]
    gone = [n for n in stages if n.startswith(("export-", "aot-", "gate-", "doctor-")) and n.endswith("rwkv7-tiny-fp32")
            or n.startswith("aot-rwkv7-tiny-") and n.endswith("-fp32")]
    assert len(gone) >= 4
    (tree / "dvc.yaml").write_text(yaml.safe_dump({"stages": {n: st for n, st in stages.items() if n not in gone}}))
    found = status.survey(config.load(tree / "config.yaml"), tree)
    rows = {r["recipe"]: r for r in found.rows}
    assert (rows["fp32"]["stale"], rows["fp16"]["stale"]) == ("unknown: not in dvc.yaml", "no")
    assert rows["fp32"]["built"] == "yes (68.9 MB)" and rows["fp32"]["gate"] == "pass"
    assert [str(p) for p in found.problems] == [
        f"{tree / 'dvc.yaml'}: has no stages for rwkv7-tiny's recipe fp32 (no stage writes "
        f"results/rwkv7-tiny/export/fp32), which the config builds -- fix: {status.REGENERATE}"]
    cfg = config.load(tree / "config.yaml")
    cfg["build"] = ["rwkv6-tiny"]  # rwkv7-tiny's rows come from its results/ only
    found = status.survey(cfg, tree)
    assert found.problems == [] and {r["model"]: r["stale"] for r in found.rows if r["recipe"] == "fp32"} == \
        {"rwkv6-tiny": "-", "rwkv7-tiny": "unknown: not in dvc.yaml"}


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


def test_the_rows_of_a_real_build(tiny_results, smk_repo, tmp_path):
    """The session's real build (stage entry points, real gates, the dvc.lock its Snakemake run
    recorded): every recipe of every built model built, gated, staged and not stale -- so every
    stage dvc.yaml puts behind a row is one that run recorded -- and a code edit marks exactly the
    rows whose stages ran it."""
    from recurrent_coreai.pipeline import config

    tree, record = Path(smk_repo[1]["tiny"]["tree"]), smk_repo[1]
    root = tmp_path / "root"  # the built copy as committed (its code, config.yaml, dvc.yaml), its results
    root.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=tree, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    (root / "dvc.lock").write_text(record["dvc_lock"])  # as the build left it
    (root / "results").symlink_to(tiny_results)
    cfg = config.load(root / "config.yaml")
    found = status.survey(cfg, root)
    assert found.problems == []
    rows = {(r["model"], r["recipe"]): r for r in found.rows}
    assert sorted(rows) == sorted((m, r) for m in config.models_to_build(cfg) for r in cfg["models"][m]["recipes"])
    for (model, recipe), row in rows.items():
        gate = json.loads(Layout(tiny_results, model).gate_json(recipe).read_text())
        assert row["built"].startswith("yes") and row["gate"] == "pass", row
        assert row["top-1"] == f"{gate['agree_counted']}/{gate['counted']}"
        assert float(row["max|dlogits|"]) == pytest.approx(gate["max_abs_dlogits"], rel=1e-2)
        assert row["published"] == "staged" and row["stale"] == "no", row
    family = cfg["models"]["rwkv7-tiny"]["family"]
    with open(root / f"recurrent_coreai/families/{family}/__init__.py", "a") as fh:
        fh.write("\n# edited\n")
    stale = {(r["model"], r["recipe"]): r["stale"] for r in status.survey(cfg, root).rows}
    for (model, recipe), why in stale.items():
        if cfg["models"][model]["family"] == family:
            assert why.startswith("code: ") and {"export", "source"} <= set(why[6:].split(", ")), (model, why)
        else:
            assert why == "no", (model, why)
