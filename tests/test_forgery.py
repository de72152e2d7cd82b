"""Records verified by what they are derived from, not by their own seal (stages/derivation.py).

A seal is a sha256 anyone can recompute: each forgery here edits a derived record and seals it
again (``records.sealed_text`` / ``records.seal_card`` / ``records.seal_report``), so every seal
and every recorded digest still holds. On a hard-linked copy of the session's built tree
(``tiny_results``; every change writes a new inode), the publish stage (in-process, the rule's
inputs) and DVC's recording check (``dvc_record.unverified`` with what scripts/dvc_record.py passes
it) must each refuse it in ONE line naming the forged record and the file it disagrees with, and
stage nothing. The untouched tree passes both (no false refusals), whatever SOURCE_DATE_EPOCH says.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from recurrent_coreai.pipeline import dvc_record, records
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.stages import derivation
from recurrent_coreai.util.fsutil import sha256_file, tree_manifest
from tampering import rewrite

ROOT = Path(__file__).resolve().parents[1]
MODEL, RECIPE, TARGET = "rwkv7-tiny", "fp16", "universal"


@pytest.fixture(scope="module")
def built(request) -> Path:
    """The session's built tree; RECURRENT_COREAI_TEST_RESULTS may name another (repo_copies.snapshot_results)."""
    override = os.environ.get("RECURRENT_COREAI_TEST_RESULTS")
    return Path(override) if override else request.getfixturevalue("tiny_results")


@pytest.fixture
def base(built, tmp_path, monkeypatch) -> Path:
    """A hard-linked copy of the built tree with its config, as the working directory (the dvc.yaml
    commands name ``results/...`` and ``config.yaml`` relative to it)."""
    shutil.copytree(built, tmp_path / "results", symlinks=True, copy_function=os.link)
    cfg = yaml.safe_load((built.parent / "config.yaml").read_text())
    cfg["results"] = "results"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def dvc_stages() -> dict:
    """The model's stages as dvc.yaml describes them (their commands name every input)."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    return {name: st for name, st in stages.items() if MODEL in name}


def stage_named(script: str, **having: str) -> tuple[str, dict]:
    for name, st in dvc_stages().items():
        s, args = derivation.cmd_args(st["cmd"])
        if s == script and all(args.get(k) == [v] for k, v in having.items()):
            return name, st
    raise AssertionError(f"no {script} stage of {MODEL} in dvc.yaml with {having}")


def publish(capsys) -> tuple[int, list[str]]:
    from recurrent_coreai.stages import publish as stage

    _, st = stage_named("publish", model=MODEL)
    argv = st["cmd"].split("scripts/publish.py", 1)[1].split()
    argv = argv[:argv.index("--log")]
    capsys.readouterr()
    rc = stage.main(argv)
    return rc, capsys.readouterr().err.splitlines()


def dvc_refuses(stage: tuple[str, dict]) -> str:
    name, st = stage
    bad = dvc_record.unverified({name: st}, [name], derivation.check_stage)
    assert list(bad) == [name], f"{name}: recorded anyway"
    return str(bad[name])


# --- the forgeries: each leaves every seal and recorded digest intact ------------------------------
def resealed_gate(path: Path) -> None:
    """The issue's example: the gate's summary numbers improved, the seal recomputed."""
    record = json.loads(path.read_text())
    record.update(max_abs_dlogits=1e-06, mean_kl=0.0)
    rewrite(path, records.sealed_text(record, "gate").encode())


def resealed_card(path: Path) -> None:
    """A number in the card's text changed, its seal line recomputed."""
    text = records.read_card(path)
    line = next(ln for ln in text.splitlines() if ln.startswith(f"| `{RECIPE}` |") and ln.count("|") >= 9)
    cells = line.split("|")
    cells[6] = " 1e-06 "  # the gate table's max abs dlogits
    rewrite(path, records.seal_card(text.replace(line, "|".join(cells), 1)).encode())


def resealed_report(path: Path) -> None:
    html = records.read_report(path)
    assert "PASS" in html
    rewrite(path, records.seal_report(html.replace("PASS", "PASS (forged)", 1)).encode())


def export_dir(base: Path) -> Path:
    return Layout(base / "results", MODEL).export(RECIPE)


def bundle_file(base: Path) -> Path:
    record = records.read_export(export_dir(base), files=False)
    return sorted(p for p in (export_dir(base) / record["bundle"]).rglob("*") if p.is_file())[0]


def resealed_export(base: Path, change_bundle: bool) -> Path:
    """export.json's digest of one bundle file replaced by the digest of other bytes; with
    ``change_bundle`` the file holds those bytes (bundle and record forged together)."""
    path = export_dir(base) / records.EXPORT
    record = json.loads(path.read_text())
    target = bundle_file(base)
    rel = target.relative_to(export_dir(base) / record["bundle"]).as_posix()
    data = target.read_bytes() + b"\0"
    if change_bundle:
        rewrite(target, data)
    import hashlib

    record["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    record["size_bytes"] = sum(f["size"] for f in record["files"].values())
    rewrite(path, records.sealed_text(record, "export").encode())
    return target


def check_line(line: str, record: Path, source: Path, rule: str) -> None:
    """One line: ``<record>: disagrees with <...source...>: ... -- fix: ... --forcerun <rule>`` (the
    paths as the stage's command names them: relative to the working directory)."""
    record, source = (Path(os.path.relpath(p)) for p in (record, source))
    assert "\n" not in line and "internal error" not in line, line
    assert line.startswith(f"{record}: disagrees with "), line
    assert str(source) in line.split(" -- fix: ")[0], line
    assert line.endswith(f"--forcerun {rule}"), line


# --- the untouched tree ----------------------------------------------------------------------------
def test_the_untouched_tree_passes_every_derivation_check(base, capsys, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")  # another date than the build's: the date is not derived
    for name, st in dvc_stages().items():
        assert dvc_record.unverified({name: st}, [name], derivation.check_stage) == {}, name
    rc, err = publish(capsys)
    assert rc == 0, err
    assert records.read_receipt(Layout(base / "results", MODEL).publish)


def test_dvc_record_script_checks_derivations():
    """scripts/dvc_record.py passes stages.derivation.check_stage to the recording."""
    spec = importlib.util.spec_from_file_location("dvc_record_script", ROOT / "scripts" / "dvc_record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.check_stage is derivation.check_stage
    assert "main(derived=check_stage)" in (ROOT / "scripts" / "dvc_record.py").read_text()


# --- refused by publish and by DVC's recording -----------------------------------------------------
def refused_by_publish(base: Path, capsys) -> str:
    out = Layout(base / "results", MODEL).publish
    before = tree_manifest(out)
    rc, err = publish(capsys)
    assert rc == 1, "published anyway"
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert tree_manifest(out) == before, "the earlier staging tree changed"
    assert not list(out.parent.glob(".publish.*.tmp")), "a temporary was left behind"
    return err[0].removeprefix("error: ")


def test_a_resealed_gate_summary_is_refused(base, capsys):
    lay = Layout(base / "results", MODEL)
    json_path, tsv = lay.gate_json(RECIPE), lay.gate_tsv(RECIPE)
    resealed_gate(json_path)
    records.read_gate(json_path, tsv=True)  # every seal and digest holds
    line = refused_by_publish(base, capsys)
    print(line)
    check_line(line, json_path, tsv, "gate")
    assert "max_abs_dlogits is 1e-06" in line, line
    line = dvc_refuses(stage_named("gate", model=MODEL, recipe=RECIPE))
    print(line)
    check_line(line, json_path, tsv, "gate")


def test_a_gate_summary_with_other_thresholds_is_refused(base, capsys):
    """A gate JSON claiming looser thresholds than the config's (resealed): refused, the config named."""
    lay = Layout(base / "results", MODEL)
    record = json.loads(lay.gate_json(RECIPE).read_text())
    record["thresholds"] = {**record["thresholds"], "min_agree": 0.0}
    rewrite(lay.gate_json(RECIPE), records.sealed_text(record, "gate").encode())
    line = refused_by_publish(base, capsys)
    assert line.startswith(f"{os.path.relpath(lay.gate_json(RECIPE))}: disagrees with the config in force: "
                           "thresholds is "), line


def test_a_resealed_card_is_refused(base, capsys):
    lay = Layout(base / "results", MODEL)
    resealed_card(lay.card)
    records.read_card(lay.card)
    line = refused_by_publish(base, capsys)
    print(line)
    check_line(line, lay.card, lay.gate_json("fp32"), "card")
    line = dvc_refuses(stage_named("card", model=MODEL))
    print(line)
    check_line(line, lay.card, lay.gate_json("fp32"), "card")


def test_a_card_rendered_from_a_resealed_gate_is_refused_by_dvc(base):
    """What `snakemake … --forcerun stage_and_push` does after the gate forgery: Snakemake reruns
    the card from the forged gate JSON (the card agrees with it); recording the card checks the
    gates it is rendered from too."""
    from recurrent_coreai.pipeline import config as cfgmod
    from recurrent_coreai.stages import card

    lay = Layout(Path("results"), MODEL)
    resealed_gate(lay.gate_json(RECIPE))
    name, st = stage_named("card", model=MODEL)
    _, a = derivation.cmd_args(st["cmd"])
    settings = cfgmod.settings(cfgmod.load("config.yaml"), "card", model=MODEL)
    rewrite(lay.card, card.card_text(MODEL, settings, lay.source, lay.vocab, Path(a["toolchain"][0]),
                                     list(map(Path, a["exports"])), list(map(Path, a["gates"])), None,
                                     card.build_date()).encode())
    derivation.check_card(lay.card, MODEL, settings, lay.source, lay.vocab, Path(a["toolchain"][0]),
                          list(map(Path, a["exports"])), list(map(Path, a["gates"])), None)  # the card agrees
    line = dvc_refuses((name, st))
    print(line)
    check_line(line, lay.gate_json(RECIPE), lay.gate_tsv(RECIPE), "gate")
    line = dvc_refuses(stage_named("report", model=MODEL))
    check_line(line, lay.gate_json(RECIPE), lay.gate_tsv(RECIPE), "gate")


def test_a_resealed_report_is_refused_by_dvc(base):
    """The report is not staged (no stage after it reads it): DVC's recording refuses it."""
    lay = Layout(base / "results", MODEL)
    page = lay.base / "report" / "index.html"
    resealed_report(page)
    records.read_report(page)
    line = dvc_refuses(stage_named("report", model=MODEL))
    print(line)
    check_line(line, page, lay.gate_json("fp32"), "report")


def test_export_digests_changed_without_the_bundle_are_refused(base, capsys):
    """export.json's digests changed and resealed: the bundle file and export.json both named."""
    target = resealed_export(base, change_bundle=False)
    path = export_dir(base) / records.EXPORT
    target, path = Path(os.path.relpath(target)), Path(os.path.relpath(path))
    for line in (refused_by_publish(base, capsys), dvc_refuses(stage_named("export", model=MODEL, recipe=RECIPE))):
        print(line)
        assert line.startswith(f"{target}: differs from what the export stage recorded in {path}"), line
        assert line.endswith("--forcerun export") and "\n" not in line, line


def test_a_bundle_changed_with_its_export_digests_is_refused(base, capsys):
    """Bundle bytes and export.json changed together (resealed): the gate tested other bytes."""
    lay = Layout(base / "results", MODEL)
    resealed_export(base, change_bundle=True)
    records.read_export(export_dir(base))  # export.json and the bundle agree
    path = export_dir(base) / records.EXPORT
    line = refused_by_publish(base, capsys)
    print(line)
    check_line(line, lay.gate_json(RECIPE), path, "gate")
    line = dvc_refuses(stage_named("gate", model=MODEL, recipe=RECIPE))
    check_line(line, lay.gate_json(RECIPE), path, "gate")
    line = dvc_refuses(stage_named("aot", model=MODEL, recipe=RECIPE, target=TARGET))
    print(line)
    check_line(line, lay.aot(TARGET, RECIPE) / records.AOT, path, "aot")


def test_a_gate_run_against_another_reference_is_refused(base, capsys):
    lay = Layout(base / "results", MODEL)
    record = json.loads(lay.gate_json(RECIPE).read_text())
    assert record["reference_sha256"] == sha256_file(lay.reference)
    record["reference_sha256"] = "0" * 64
    rewrite(lay.gate_json(RECIPE), records.sealed_text(record, "gate").encode())
    line = refused_by_publish(base, capsys)
    check_line(line, lay.gate_json(RECIPE), lay.reference, "gate")


# --- with a key: RECURRENT_COREAI_RECORD_KEY -----------------------------------------------------
KEY = "test-record-key-0123456789"


def consistent_gate_forgery(json_path: Path) -> None:
    """The forgery the checks above cannot see: TSV rows and summary changed together (every
    max_abs_dlogits divided by 1000, the verdict recomputed, the TSV digest and seal recomputed)."""
    from recurrent_coreai.stages import gate

    record = json.loads(json_path.read_text())
    tsv = json_path.with_name(record["tsv"]["name"])
    rows = derivation.tsv_rows(tsv, tsv.read_text())
    for r in rows:
        r["max_abs_dlogits"] = float(f"{r['max_abs_dlogits'] / 1000:.6g}")
    text = gate.tsv_text(rows)
    rewrite(tsv, text.encode())
    verdict = gate.verdict(rows, record["thresholds"])
    record.update({k: v for k, v in verdict.items() if k not in ("pass", "reasons")})
    record["tsv"]["sha256"] = records._digest(text)
    rewrite(json_path, records.sealed_text(record, "gate").encode())


def seal_every_record(results: Path) -> int:
    """What a build with the key set writes: every sealed JSON record sealed (with its MAC) again."""
    n = 0
    for path in sorted(results.rglob("*.json")):
        record = json.loads(path.read_text())
        if isinstance(record, dict) and isinstance(record.get(records.SEAL), dict):
            rewrite(path, records.sealed_text(record, record[records.SEAL]["stage"]).encode())
            n += 1
    return n


def test_the_consistent_forgery_passes_without_a_key_and_is_refused_with_one(base, capsys, monkeypatch):
    lay = Layout(base / "results", MODEL)
    monkeypatch.setenv("RECURRENT_COREAI_RECORD_KEY", KEY)
    assert seal_every_record(base / "results") > 10
    assert "hmac" in json.loads(lay.gate_json(RECIPE).read_text())[records.SEAL]
    rc, err = publish(capsys)  # a build with the key: publishes with the key
    assert rc == 0, err
    monkeypatch.delenv("RECURRENT_COREAI_RECORD_KEY")
    consistent_gate_forgery(lay.gate_json(RECIPE))  # the forger has no key
    derivation.check_stage(stage_named("gate", model=MODEL, recipe=RECIPE)[1])  # consistent: passes every check
    monkeypatch.setenv("RECURRENT_COREAI_RECORD_KEY", KEY)
    line = refused_by_publish(base, capsys)
    print(line)
    assert line == (f"{os.path.relpath(lay.gate_json(RECIPE))}: differs from what the gate stage recorded: its MAC is not one made "
                     "with RECURRENT_COREAI_RECORD_KEY (sealed without that key, with another one, or forged) -- fix: "
                     "rerun it: snakemake --cores 1 publish --forcerun gate"), line
    assert KEY not in line
    bad = dvc_record.unverified({"gate": {"outs": [str(lay.gate_json(RECIPE))]}}, ["gate"], derivation.check_stage)
    assert "its MAC is not one made with RECURRENT_COREAI_RECORD_KEY" in str(bad["gate"])


def test_the_record_key_is_never_written_and_optional(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    monkeypatch.setenv("RECURRENT_COREAI_RECORD_KEY", KEY)
    path.write_text(records.sealed_text({"a": 1}, "gate"))
    assert KEY not in path.read_text() and records.check_seal(path, "gate")["a"] == 1
    monkeypatch.setenv("RECURRENT_COREAI_RECORD_KEY", KEY + "x")  # another key
    with pytest.raises(records.PipelineError, match="its MAC is not one made with"):
        records.check_seal(path, "gate")
    monkeypatch.delenv("RECURRENT_COREAI_RECORD_KEY")  # without a key: as before the key existed
    assert records.check_seal(path, "gate")["a"] == 1
    plain = records.sealed_text({"a": 1}, "gate")
    assert "hmac" not in plain
    path.write_text(plain)
    monkeypatch.setenv("RECURRENT_COREAI_RECORD_KEY", KEY)  # a record sealed without the key: refused with it
    with pytest.raises(records.PipelineError, match="its MAC is not one made with"):
        records.check_seal(path, "gate")
