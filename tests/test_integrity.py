"""The integrity chain (pipeline/records.py): every file a stage writes under results/<model>/ is
checked against its stage's record before anything is staged or published, and before DVC records it.

For every kind of file the stages write, on a copy of the session's built tree (``tiny_results``):
change it after its stage, keep its time (os.utime, as a careful attacker or a stray editor
would), and

* publish (the publish stage with the rule's inputs: what ``snakemake publish --forcerun
  stage_and_push`` runs): one line naming the file and the stage to rerun, exit 1, and the
  earlier staging tree untouched (nothing staged, nothing published) -- every kind publish reads
  (all but the build report, a page for people that no stage after it reads);
* record it in DVC (scripts/dvc_record.py's check of the stage's out, ``records.verify_output``):
  refused, with the same line -- every kind, the report included.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from recurrent_coreai.pipeline import records
from recurrent_coreai.pipeline.paths import Layout, stage_args
from recurrent_coreai.util.fsutil import tree_manifest
from tampering import append_line, flip_byte, json_edit, resealed_json_edit, rewrite, swap_two_tokens

MODEL, TARGET, RECIPE = "rwkv7-tiny", "universal", "fp16"
RECIPES = ["fp32", "fp16", "int8keepproj"]
BUNDLE = f"{MODEL}-{RECIPE}"


def first_file(directory: Path, suffix: str = "") -> str:
    return sorted(p for p in directory.rglob(f"*{suffix}") if p.is_file() and p.name != ".snakemake_timestamp")[0]


# kind -> (path under results/ (a callable for one found in the tree), change, the stage named)
CASES = {
    "source weights": (f"{MODEL}/source/model.safetensors", flip_byte, "source"),
    "source config.json": (f"{MODEL}/source/config.json", append_line, "source"),
    "source manifest.json": (f"{MODEL}/source/manifest.json", json_edit("layout", "edited"), "source"),
    "vocab rwkv_vocab.tsv (two tokens swapped)": (f"{MODEL}/vocab/rwkv_vocab.tsv", swap_two_tokens, "vocab"),
    "vocab record": (f"{MODEL}/vocab/{records.VOCAB_RECORD}", json_edit("files", {}), "vocab"),
    "reference stream.npz": (f"{MODEL}/reference/stream.npz", flip_byte, "reference"),
    "export.json size_bytes": (f"{MODEL}/export/{RECIPE}/export.json", json_edit("size_bytes", 1), "export"),
    "export.json, canonical, old seal": (f"{MODEL}/export/{RECIPE}/export.json",
                                         resealed_json_edit("size_bytes", 1), "export"),
    "bundle file (.aimodel)": (lambda r: first_file(r / MODEL / "export" / RECIPE / f"{BUNDLE}.aimodel"),
                               flip_byte, "export"),
    "aot.json": (f"{MODEL}/aot/{TARGET}/{RECIPE}/aot.json", json_edit("product", "x.aimodelx"), "aot"),
    "lowered file (.aimodelx)": (lambda r: first_file(r / MODEL / "aot" / TARGET / RECIPE / f"{BUNDLE}.aimodelx"),
                                 flip_byte, "aot"),
    "gate JSON max_abs_dlogits": (f"{MODEL}/gate/{RECIPE}.json", json_edit("max_abs_dlogits", 1e-06), "gate"),
    "gate TSV": (f"{MODEL}/gate/{RECIPE}.tsv", append_line, "gate"),
    "gate shard record": (f"{MODEL}/gate/{RECIPE}/shard-0.json", json_edit("shards", 2), "gate_shard"),
    "doctor JSON": (lambda r: first_file(r / MODEL / "gate", ".doctor.json"), json_edit("findings", 7), "doctor"),
    "card README.md": (f"{MODEL}/card/README.md", append_line, "card"),
    "toolchain.json": ("toolchain.json", json_edit("versions", {"torch": "0"}), "toolchain"),
    "report index.html": (f"{MODEL}/report/index.html", append_line, "report"),
}
# publish reads the gate's verdict, not the shard records it was gathered from (the gate checked them)
PUBLISH_READS = [kind for kind, (_, _, stage) in CASES.items() if stage not in ("report", "gate_shard")]


def dvc_out(results: Path, path: Path) -> Path:
    """The DVC ``out`` (dvc.yaml) holding ``path``: a directory stage's directory (source, vocab,
    export/<r>, aot/<t>/<r>), else the file itself."""
    parts = path.relative_to(results).parts
    if len(parts) > 2 and parts[1] in ("source", "vocab"):
        return results.joinpath(*parts[:2])
    if len(parts) > 3 and parts[1] == "export":
        return results.joinpath(*parts[:3])
    if len(parts) > 4 and parts[1] == "aot":
        return results.joinpath(*parts[:4])
    return path


@pytest.fixture(scope="module")
def built(request) -> Path:
    """The session's built tree (``tiny_results``); RECURRENT_COREAI_TEST_RESULTS may name another
    results tree made by repo_copies.snapshot_results (a config.yaml beside it), e.g. while the
    shared build is broken by an unrelated model."""
    override = os.environ.get("RECURRENT_COREAI_TEST_RESULTS")
    return Path(override) if override else request.getfixturevalue("tiny_results")


def copy_results(src: Path, dst: Path, link: bool = False) -> None:
    """What the stages of MODEL read of results tree ``src`` (its folder, toolchain.json), file times
    kept: copied, or hard-linked (every change in tampering.py writes a new inode). The whole tree
    is 1.5 GB, copied once per case before (~16 GB a run)."""
    copy = os.link if link else shutil.copy2
    shutil.copytree(src / MODEL, dst / MODEL, symlinks=True, copy_function=copy)
    copy(src / "toolchain.json", dst / "toolchain.json")


@pytest.fixture(scope="module")
def tree(tmp_path_factory, built) -> Path:
    """A copy of the built tree's MODEL (file times kept) and its config, per module."""
    base = tmp_path_factory.mktemp("integrity")
    copy_results(built, base / "results")
    cfg = yaml.safe_load((built.parent / "config.yaml").read_text())
    cfg["results"] = str(base / "results")
    (base / "config.yaml").write_text(yaml.safe_dump(cfg))
    return base


def publish_argv(base: Path, out: Path) -> list[str]:
    results = base / "results"
    lay = Layout(results, MODEL)
    return ["--config-file", str(base / "config.yaml"), "--model", MODEL,
            *stage_args("publish", results, MODEL, RECIPES, [TARGET]),
            "--tsvs", *[str(lay.gate_tsv(r)) for r in RECIPES], "--reference", str(lay.reference),
            "--doctors", *[str(p) for p in sorted((results / MODEL / "gate").glob("*.doctor.json"))],
            "--out", str(out)]


def run_publish(base: Path, out: Path, capsys) -> tuple[int, list[str]]:
    from recurrent_coreai.stages import publish

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        os.environ.pop(var, None)
    capsys.readouterr()
    rc = publish.main(publish_argv(base, out))
    return rc, capsys.readouterr().err.splitlines()


def test_the_untouched_tree_publishes_and_every_output_verifies(tree, capsys):
    out = tree / "staged" / "publish"
    rc, err = run_publish(tree, out, capsys)
    assert rc == 0, err
    receipt = records.read_receipt(out)
    assert "rwkv_vocab.tsv" in receipt["tokenizer_files"] and records.VOCAB_RECORD not in receipt["tokenizer_files"]
    assert not any(rel.endswith(records.VOCAB_RECORD) for rel in receipt["files"])
    # every output of every stage is sealed and verifies (the report's is the report stage's own)
    kinds = {}
    for path in sorted((tree / "results" / MODEL).iterdir()):
        for out_path in ([path] if path.name in ("source", "vocab", "publish") else
                         sorted(p for p in path.glob("*/*") if p.is_dir()) if path.name == "aot" else
                         sorted(p for p in path.rglob("*") if p.is_file()) if path.name == "gate" else
                         sorted(path.iterdir()) if path.name in ("export", "card", "reference", "report")
                         else []):
            kinds[out_path.relative_to(tree / "results").as_posix()] = records.verify_output(out_path)
    assert "unrecorded" not in kinds.values(), kinds
    assert {"manifest.json", "export.json", "aot.json", records.VOCAB_RECORD, "publish.json", "stream", "tsv",
            "card", "json", "report", "gate_shard"} <= set(kinds.values()), kinds
    assert kinds[f"{MODEL}/report/index.html"] == "report"


@pytest.mark.parametrize("kind", PUBLISH_READS)
def test_a_file_changed_after_its_stage_is_never_published(tree, tmp_path, capsys, kind):
    where, change, stage = CASES[kind]
    base = tmp_path / "copy"
    copy_results(tree / "results", base / "results", link=True)
    cfg = yaml.safe_load((tree / "config.yaml").read_text())
    cfg["results"] = str(base / "results")
    (base / "config.yaml").write_text(yaml.safe_dump(cfg))
    path = where(base / "results") if callable(where) else base / "results" / where
    before_time = path.stat().st_mtime_ns
    change(path)
    assert path.stat().st_mtime_ns == before_time
    out = Layout(base / "results", MODEL).publish
    staged_before = tree_manifest(out)
    rc, err = run_publish(base, out, capsys)
    assert rc == 1, f"{kind}: published anyway"
    assert len(err) == 1, err
    line = err[0]
    print(f"{kind}: {line}")
    assert line.startswith("error: ") and " -- fix: " in line, line
    assert str(base / "results") in line, line  # names the file (or its directory)
    named = line.split(": ", 2)[1]
    assert Path(named) == path or Path(named) in path.parents or path in Path(named).parents, line
    rule = {"publish": "stage_and_push"}.get(stage, stage)
    assert f"differs from what the {stage} stage recorded" in line, line
    assert line.endswith(f"--forcerun {rule}"), line
    assert "internal error" not in line, line
    assert tree_manifest(out) == staged_before, "the earlier staging tree changed"
    assert not list(out.parent.glob(".publish.*.tmp")), "a temporary was left behind"


@pytest.mark.parametrize("kind", list(CASES))
def test_a_file_changed_after_its_stage_is_never_recorded_in_dvc(tree, tmp_path, kind):
    """What dvc_record checks before ``dvc commit``: the stage's out holding the changed file is
    refused with one line naming the file and the stage to rerun (a hard-linked copy: every change
    here writes a new inode)."""
    from recurrent_coreai.pipeline import dvc_record

    where, change, stage = CASES[kind]
    results = tmp_path / "results"
    copy_results(tree / "results", results, link=True)
    path = where(results) if callable(where) else results / where
    out = dvc_out(results, path)
    assert records.verify_output(out) != "unrecorded"
    change(path)
    bad = dvc_record.unverified({"changed": {"outs": [str(out)]}}, ["changed"])
    assert list(bad) == ["changed"], f"{kind}: recorded anyway"
    line = str(bad["changed"])
    print(f"{kind}: {line}")
    assert "\n" not in line and " -- fix: " in line, line
    named = Path(line.split(": ", 1)[0])
    assert named == path or named in path.parents or path in named.parents, line
    assert f"differs from what the {stage} stage recorded" in line, line
    assert line.endswith(f"--forcerun {({'publish': 'stage_and_push'}.get(stage, stage))}"), line


def test_a_staged_file_changed_after_staging_is_never_uploaded(tree, tmp_path):
    """The publish directory: publish.json and every staged file verify before an upload."""
    from recurrent_coreai.hub.upload import upload_tree

    out = tmp_path / "publish"
    shutil.copytree(tree / "staged" / "publish", out, copy_function=shutil.copy2)
    receipt = records.read_receipt(out)
    target = out / "universal" / BUNDLE / "rwkv_vocab.tsv"
    swap_two_tokens(target)
    with pytest.raises(records.PipelineError) as exc:
        records.read_receipt(out)
    assert str(exc.value).startswith(f"{target}: differs from what the publish stage recorded"), exc.value
    expected = {rel: v["sha256"] for rel, v in receipt["files"].items()}
    view = tmp_path / "view"  # what push uploads: the staged tree without the local receipt
    shutil.copytree(out, view, ignore=shutil.ignore_patterns(records.RECEIPT), copy_function=shutil.copy2)
    target = view / "universal" / BUNDLE / "rwkv_vocab.tsv"
    with pytest.raises(records.PipelineError) as exc:
        upload_tree("tester/x", view, message="m", token="hf_x", expected=expected)  # refused before any network
    assert "nothing was uploaded" in str(exc.value) and str(target) in str(exc.value), exc.value
    json_edit("model", "other")(out / records.RECEIPT)
    shutil.copy2(view / "universal" / BUNDLE / "rwkv_vocab.tsv", out / "universal" / BUNDLE / "rwkv_vocab.tsv")
    with pytest.raises(records.PipelineError) as exc:
        records.read_receipt(out)
    assert "differs from what the publish stage recorded" in str(exc.value)


def test_provenance_attests_only_verified_digests(tree, tmp_path):
    from recurrent_coreai.hub import provenance

    folder = tmp_path / "aimodel" / BUNDLE
    shutil.copytree(tree / "staged" / "publish" / "aimodel" / BUNDLE, folder)
    for name in provenance.provenance_files(folder):
        (folder / name).unlink(missing_ok=True)
    verified = {rel: v["sha256"] for rel, v in tree_manifest(folder).items()}
    assert provenance.subjects(folder, verified)  # the recorded bytes: attested
    flip_byte(folder / "export.json")
    with pytest.raises(records.PipelineError) as exc:
        provenance.subjects(folder, verified)
    assert "it is not attested" in str(exc.value) and "export.json" in str(exc.value)


def test_dvc_records_only_outputs_that_verify(tree, tmp_path):
    from recurrent_coreai.pipeline import dvc_record

    base = tmp_path / "r"
    shutil.copytree(tree / "results" / MODEL / "gate", base / "gate", copy_function=shutil.copy2)
    stages = {"gate-ok": {"outs": [str(base / "gate" / "fp32.json"), str(base / "gate" / "fp32.tsv")]},
              "gate-changed": {"outs": [str(base / "gate" / f"{RECIPE}.json"), str(base / "gate" / f"{RECIPE}.tsv")]}}
    json_edit("max_abs_dlogits", 1e-06)(base / "gate" / f"{RECIPE}.json")
    bad = dvc_record.unverified(stages, list(stages))
    assert list(bad) == ["gate-changed"], bad
    assert "differs from what the gate stage recorded" in str(bad["gate-changed"])


def test_status_reads_a_changed_gate_record_as_corrupt(tree, tmp_path):
    from recurrent_coreai.tools import status

    gate = tmp_path / "fp16.json"
    shutil.copy2(tree / "results" / MODEL / "gate" / f"{RECIPE}.json", gate)
    rerun = status.Rerun("gate-rwkv7-tiny-fp16", gate)
    assert status.read_record(gate, {"pass": bool}, rerun)["pass"] is True
    json_edit("max_abs_dlogits", 1e-06)(gate)
    with pytest.raises(records.PipelineError) as exc:
        status.read_record(gate, {"pass": bool}, rerun)
    assert "differs from what the gate stage recorded" in str(exc.value) and str(gate) in str(exc.value)
