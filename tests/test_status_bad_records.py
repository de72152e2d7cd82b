"""`python -m recurrent_coreai status` on records it cannot read: a gate JSON, export.json,
publish.json or toolchain.json that is truncated, a JSON list, missing a key or binary, a
broken dvc.lock, a broken or missing dvc.yaml. The table still prints (the cell says ``corrupt``, never ``-`` or ``no``), then
ONE line per broken record on stderr naming the file and the stage to rerun, exit 1 -- never
"internal error ... this is a bug". And ``status | head -3`` ends quietly with exit 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from recurrent_coreai.pipeline import dag
from recurrent_coreai.tools import status
from test_status import tree  # noqa: F401 - the fixture: a built rwkv7-tiny tree (fp32 passed, fp16 failed)

GATE, FAILED = "results/rwkv7-tiny/gate/fp32.json", "results/rwkv7-tiny/gate/fp16.failed.json"
EXPORT = "results/rwkv7-tiny/export/fp32/export.json"
RECEIPT, TOOLCHAIN = "results/rwkv7-tiny/publish/publish.json", "results/toolchain.json"
BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"


def truncated(text: str) -> str:
    return text[: len(text) // 2]


def without(key: str):
    return lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != key})


def run(capsys) -> tuple[int, dict[str, dict[str, str]], list[str]]:
    capsys.readouterr()
    rc = status.main([])  # the fixture's cwd is the tree: config.yaml, dvc.lock, results/ there
    out, err = capsys.readouterr()
    lines = out.splitlines()
    head = lines[0].split()
    rows = {}
    for line in lines[1:]:
        cells = line.split(None, 2)  # model, recipe, then the rest (the built cell may hold spaces)
        rows[cells[1]] = line
    assert head[:2] == ["model", "recipe"], out
    return rc, rows, err.splitlines()


def edit(root: Path, rel: str, change) -> None:
    path = root / rel
    if isinstance(change, bytes):
        path.write_bytes(change)
    else:
        path.write_text(change(path.read_text()))


def check_one_line(err: list[str], rel: str, what: str, fix: str) -> str:
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith(f"error: {rel}: "), line
    assert what in line.split(" -- fix: ")[0] and line.split(" -- fix: ")[1] == fix, line
    assert "internal error" not in line and "bug" not in line, line
    return line


@pytest.mark.parametrize("rel, change, what", [
    (GATE, truncated, "is not valid JSON (truncated?"),
    (GATE, lambda t: "[1, 2]", "is a list, not a JSON object"),
    (GATE, without("counted"), "has no 'counted'"),
    (GATE, lambda t: t.replace('"agree_counted": 40', '"agree_counted": "40"'), "'agree_counted' is a string"),
    (GATE, BINARY, "is not a JSON record (binary, 18 bytes)"),
    (GATE, lambda t: "", "is empty"),
    (FAILED, truncated, "is not valid JSON"),
], ids=["truncated", "a-list", "missing-key", "wrong-type", "binary", "empty", "failed-record-truncated"])
def test_a_corrupt_gate_record_reads_corrupt_and_names_the_stage(tree, capsys, rel, change, what):
    recipe = Path(rel).name.split(".")[0]
    edit(tree, rel, change)
    rc, rows, err = run(capsys)
    assert rc == 1
    assert rows[recipe].split()[5] == "corrupt", rows[recipe]  # the gate column
    assert rows[recipe].split()[6:8] == ["-", "-"], rows[recipe]  # top-1, max|dlogits|
    print(check_one_line(err, rel, what, f"rerun its stage gate-rwkv7-tiny-{recipe}: snakemake --cores 1 --force "
                         f"results/rwkv7-tiny/gate/{recipe}.json"))
    other = "fp16" if recipe == "fp32" else "fp32"
    assert "corrupt" not in rows[other], rows[other]  # the healthy row is shown as before


@pytest.mark.parametrize("change, what", [
    (truncated, "is not valid JSON"),
    (lambda t: "[]", "is a list, not a JSON object"),
    (without("size_bytes"), "has no 'size_bytes'"),
    (BINARY, "binary"),
], ids=["truncated", "a-list", "missing-key", "binary"])
def test_a_corrupt_export_record_reads_corrupt(tree, capsys, change, what):
    edit(tree, EXPORT, change)
    rc, rows, err = run(capsys)
    assert rc == 1 and rows["fp32"].split()[2] == "corrupt", rows["fp32"]
    print(check_one_line(err, EXPORT, what, "rerun its stage export-rwkv7-tiny-fp32: snakemake --cores 1 --force "
                         "results/rwkv7-tiny/export/fp32"))


def test_a_corrupt_receipt_and_toolchain_record(tree, capsys):
    edit(tree, RECEIPT, truncated)
    rc, rows, err = run(capsys)
    assert rc == 1 and all(row.split()[-2] == "corrupt" for row in rows.values()), rows  # published
    print(check_one_line(err, RECEIPT, "is not valid JSON", "rerun its stage stage_and_push-rwkv7-tiny: snakemake "
                         "--cores 1 --force results/rwkv7-tiny/publish"))
    edit(tree, RECEIPT, lambda t: json.dumps({"gates": {"fp32": {}}}))
    edit(tree, TOOLCHAIN, lambda t: json.dumps({"versions": ["coreai-core"]}))
    rc, rows, err = run(capsys)
    assert rc == 1 and rows["fp32"].endswith("toolchain (toolchain.json corrupt)"), rows["fp32"]
    print(check_one_line(err, TOOLCHAIN, "'versions' is a list", "rerun its stage toolchain: snakemake --cores 1 "
                         "--force results/toolchain.json"))


@pytest.mark.parametrize("change, what", [
    (lambda t: t.replace("stages:", "stages: [", 1), "is not valid YAML at line"),
    (lambda t: "- a\n- b\n", "is not a DVC lock file (its top level is a list"),
    (lambda t: "schema: '2.0'\nstages: 3\n", "is not a DVC lock file"),
    (lambda t: yaml.safe_dump({"stages": {"toolchain": {"deps": [{"md5": "0" * 32}]}}}), "stage 'toolchain'"),
    (BINARY, "is not UTF-8 text"),
], ids=["bad-yaml", "a-list", "stages-a-number", "dep-without-path", "binary"])
def test_a_broken_dvc_lock(tree, capsys, change, what):
    edit(tree, "dvc.lock", change)
    rc, rows, err = run(capsys)
    assert rc == 1
    assert rows["fp32"].endswith("unknown: dvc.lock corrupt") and rows["int8keepproj"].endswith(" -"), rows
    print(check_one_line(err, "dvc.lock", what, status.LOCK_FIX))


def stages_of(root: Path) -> dict:
    return yaml.safe_load((root / "dvc.yaml").read_text())["stages"]


def put_stages(root: Path, stages: dict) -> None:
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))


@pytest.mark.parametrize("change, what", [
    (lambda t: t.replace("stages:", "stages: [", 1), "is not valid YAML at line"),
    (lambda t: "- a\n- b\n", "is not a DVC pipeline (its top level is a list, not a mapping)"),
    (lambda t: "stages: 3\n", "is not a DVC pipeline (its stages are a number, not a mapping)"),
    (lambda t: "# emptied\n", "is not a DVC pipeline (its top level is empty"),
    (lambda t: yaml.safe_dump({"stages": {"toolchain": ["python x.py"]}}), "stage 'toolchain' is a list, not a mapping"),
    (lambda t: yaml.safe_dump({"stages": {"toolchain": {"deps": "requirements.txt"}}}),
     "stage 'toolchain': its deps are a string, not a list of paths"),
    (lambda t: yaml.safe_dump({"stages": {"toolchain": {"outs": [3]}}}),
     "stage 'toolchain': an entry of its outs is a number, not a path"),
    (BINARY, "is not UTF-8 text"),
    (None, "not found"),
], ids=["bad-yaml", "a-list", "stages-a-number", "empty", "stage-a-list", "deps-a-string", "out-a-number", "binary",
        "missing"])
def test_a_broken_or_missing_dvc_yaml(tree, capsys, change, what):
    """dvc.yaml says which stages a row depends on: without it staleness is unknown (one line,
    the file and the fix); the records are still read, their rerun hints without a stage name."""
    if change is None:
        (tree / "dvc.yaml").unlink()
    else:
        edit(tree, "dvc.yaml", change)
    edit(tree, GATE, truncated)
    rc, rows, err = run(capsys)
    assert rc == 1
    why = "no dvc.yaml" if change is None else "dvc.yaml corrupt"
    assert rows["fp32"].endswith(f"unknown: {why}") and rows["fp16"].endswith(f"unknown: {why}"), rows
    assert rows["int8keepproj"].endswith(" -") and rows["fp16"].split()[2:5] == ["yes", "(34.5", "MB)"], rows
    assert len(err) == 2, err
    print(check_one_line(err[:1], "dvc.yaml", what, dag.DVC_YAML_FIX))
    print(check_one_line(err[1:], GATE, "is not valid JSON", "rerun the stage that writes it: snakemake --cores 1 "
                         f"--force {GATE}"))


def test_the_rerun_hint_is_the_stage_dvc_yaml_names(tree, capsys):
    """The stage that writes a record is dvc.yaml's: renamed there, renamed in the hint."""
    stages = stages_of(tree)
    stages["verify-rwkv7-tiny-fp32"] = stages.pop("gate-rwkv7-tiny-fp32")
    put_stages(tree, stages)
    edit(tree, GATE, truncated)
    rc, rows, err = run(capsys)
    assert rc == 1 and rows["fp32"].endswith("not in dvc.lock: verify"), rows["fp32"]
    print(check_one_line(err, GATE, "is not valid JSON", "rerun its stage verify-rwkv7-tiny-fp32: snakemake "
                         f"--cores 1 --force {GATE}"))


def test_a_recipe_dvc_yaml_has_no_stages_for_is_one_line(tree, capsys):
    stages = stages_of(tree)
    put_stages(tree, {n: st for n, st in stages.items() if not n.endswith("-rwkv7-tiny-fp16")
                      and not (n.startswith("aot-rwkv7-tiny-") and n.endswith("-fp16"))})
    rc, rows, err = run(capsys)
    assert rc == 1 and sorted(rows) == ["fp16", "fp32", "int8keepproj"]
    assert rows["fp16"].endswith("unknown: not in dvc.yaml") and rows["fp32"].endswith(" no"), rows
    print(check_one_line(err, "dvc.yaml", "has no stages for rwkv7-tiny's recipe fp16 (no stage writes "
                         "results/rwkv7-tiny/export/fp16), which the config builds", status.REGENERATE))


def test_every_corrupt_record_is_one_line_after_the_whole_table(tree, capsys):
    edit(tree, GATE, truncated)
    edit(tree, EXPORT, lambda t: "[]")
    edit(tree, "dvc.lock", BINARY)
    rc, rows, err = run(capsys)
    assert rc == 1 and sorted(rows) == ["fp16", "fp32", "int8keepproj"]
    assert [line.split(":")[1].strip() for line in err] == ["dvc.lock", EXPORT, GATE], err
    assert all(line.startswith("error: ") and " -- fix: " in line for line in err)
    edit(tree, "dvc.yaml", lambda t: "stages: [")
    rc, rows, err = run(capsys)
    assert rc == 1 and sorted(rows) == ["fp16", "fp32", "int8keepproj"]
    assert [line.split(":")[1].strip() for line in err] == ["dvc.yaml", "dvc.lock", EXPORT, GATE], err


def test_bad_arguments_are_one_line(tree, capsys):
    for argv, start in ((["--root", "nowhere"], "error: nowhere: --root is not a directory"),
                        (["--config-file", "nope.yaml"], "error: nope.yaml: config file not found"),
                        (["--colour"], "error: python -m recurrent_coreai status: unrecognized arguments: --colour")):
        capsys.readouterr()
        assert status.main(argv) == 1
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(start) and " -- fix: " in err[0], err


def test_a_closed_pipe_through_head_ends_quietly(tree):
    """`status | head -3` with a table far larger than the pipe's buffer (2,400 rows, ~200 KB):
    head exits after 3 lines while status is still writing. Exit 0, nothing on stderr."""
    cfg = yaml.safe_load((tree / "config.yaml").read_text())
    for i in range(800):
        cfg["models"][f"tiny-{i:03d}"] = cfg["models"]["rwkv7-tiny"]
    cfg["build"] = sorted(cfg["models"])
    (tree / "big.yaml").write_text(yaml.safe_dump(cfg))
    script = (f"{sys.executable} -m recurrent_coreai status --config-file big.yaml 2>err.txt | head -3; "
              "echo \"${PIPESTATUS[0]}\" > rc.txt")
    out = subprocess.run(["bash", "-c", script], cwd=tree, capture_output=True, text=True, timeout=120)
    assert len(out.stdout.splitlines()) == 3 and out.stdout.startswith("model"), out
    assert (tree / "err.txt").read_text() == "" and (tree / "rc.txt").read_text().strip() == "0", \
        ((tree / "err.txt").read_text(), (tree / "rc.txt").read_text())
    full = subprocess.run([sys.executable, "-m", "recurrent_coreai", "status", "--config-file", "big.yaml"],
                          cwd=tree, capture_output=True, text=True, timeout=120)
    assert full.returncode == 0 and len(full.stdout) > 150_000, len(full.stdout)  # the pipe did overflow


def test_a_deleted_gate_record_of_a_gated_recipe_reads_missing(tree, capsys):
    """The receipt records fp32 as gated: with its gate JSON gone the row is not "not gated"
    (``-``, exit 0) but ``missing``, one line naming the file and the stage, exit 1."""
    (tree / GATE).unlink()
    rc, rows, err = run(capsys)
    assert rc == 1 and rows["fp32"].split()[5] == "missing", rows["fp32"]
    assert rows["fp32"].split()[6:8] == ["-", "-"], rows["fp32"]
    check_one_line(err, GATE, f"is missing, but {RECEIPT} records recipe fp32 as gated",
                   "rerun its stage gate-rwkv7-tiny-fp32: snakemake --cores 1 --force results/rwkv7-tiny/gate/fp32.json")
    # a built recipe no receipt names is just not gated yet: '-', exit 0
    edit(tree, RECEIPT, lambda t: json.dumps({"gates": {}}))
    rc, rows, err = run(capsys)
    assert rc == 0 and err == [] and rows["fp32"].split()[5] == "-", rows["fp32"]
