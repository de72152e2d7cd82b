"""The build report stage on the built tree (no browser): the page is sealed and a rebuild from the
same inputs writes the same bytes (no run measurement in it); every input is checked against its
stage's record (a changed one is one line naming the file and the stage to rerun, and no page);
a gate that failed (``<r>.failed.json``/``.failed.tsv``, as the gate stage writes them) is shown
FAIL with its reason; a page edited after its stage is refused (records.read_report,
verify_output, dvc_record)."""

from __future__ import annotations

import csv
import os
import re
import shutil
from html import escape
from pathlib import Path

import pytest
import yaml

from recurrent_coreai.pipeline import records
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.stages import gate, report
from tampering import append_line, flip_byte, resealed_json_edit, rewrite

RESULTS = None  # the tiny results tree (conftest)
M = "rwkv7-tiny"


def recipes() -> list[str]:
    return yaml.safe_load((RESULTS.parent / "config.yaml").read_text())["models"][M]["recipes"]


def argv(results: Path, out: Path, gates: list[Path] | None = None, tsvs: list[Path] | None = None) -> list[str]:
    """The report rule's command line for ``results`` (report_inputs), with ``gates``/``tsvs`` replaced."""
    lay, rs = Layout(results, M), recipes()
    named = report.report_inputs(lay, rs)
    return ["--config-file", str(RESULTS.parent / "config.yaml"), "--model", M, "--card", str(named["card"]),
            "--gates", *map(str, gates or named["gates"]), "--tsvs", *map(str, tsvs or named["tsvs"]),
            "--exports", *map(str, named["exports"]), "--doctors", *map(str, named["doctors"]), "--out", str(out)]


def run(args: list[str], capsys) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = report.main(args)
    return rc, capsys.readouterr().err.splitlines()


def linked_copy(tmp: Path) -> Path:
    """The model's results, hard-linked (every change below writes a new inode: the shared tree
    never changes), with config.yaml beside them."""
    shutil.copytree(RESULTS / M, tmp / "results" / M, symlinks=True, copy_function=os.link)
    return tmp / "results"


def test_the_report_is_sealed_and_a_rebuild_writes_the_same_bytes(tmp_path, capsys):
    built = Layout(RESULTS, M).base / "report" / "index.html"
    assert report.report_path(Layout(RESULTS, M)) == built
    assert records.verify_output(built) == "report"
    text = built.read_text(encoding="utf-8")
    above = records.read_report(built)
    assert text == records.seal_report(above) and text.count("<!-- recurrent-coreai report sha256") == 1
    assert re.fullmatch(r"<!-- recurrent-coreai report sha256 [0-9a-f]{64} -->", text.splitlines()[-1])
    # by hand, from the same inputs at other (absolute) paths: byte for byte the build's page
    out = tmp_path / "index.html"
    rc, err = run(argv(RESULTS, out), capsys)
    assert rc == 0 and err == [], err
    assert out.read_bytes() == built.read_bytes()
    # no run measurement (a rebuild would not reproduce it): the page says where they are
    assert 'data-key="export_seconds"' not in text and 'data-key="export_rss_mb"' not in text
    assert "no log" not in text and f"results/logs/{M}/export-&lt;recipe&gt;.log" in text
    assert "<code>bench/</code>" in text and "<code>docs/measurements/</code>" in text


def _first_bundle_file(results: Path) -> Path:
    export = Layout(results, M).export("fp16")
    bundle = export / records.read_export(export, files=False)["bundle"]
    return sorted(p for p in bundle.rglob("*") if p.is_file())[0]


# kind -> (the changed file under the copy's results, the change, the stage named)
CHANGES = {
    "gate JSON": (lambda res: Layout(res, M).gate_json("fp16"), resealed_json_edit("max_abs_dlogits", 1e-06), "gate"),
    "gate TSV": (lambda res: Layout(res, M).gate_tsv("fp16"), append_line, "gate"),
    "doctor JSON": (lambda res: Layout(res, M).doctor_json("fp16"), resealed_json_edit("findings", 7), "doctor"),
    "export.json": (lambda res: Layout(res, M).export("fp16") / "export.json", resealed_json_edit("size_bytes", 1), "export"),
    "a bundle file": (_first_bundle_file, flip_byte, "export"),
    "card README.md": (lambda res: Layout(res, M).card, append_line, "card"),
}


@pytest.mark.parametrize("kind", list(CHANGES))
def test_a_changed_input_is_one_line_naming_it_and_its_stage(tmp_path, capsys, kind):
    where, change, stage = CHANGES[kind]
    results = linked_copy(tmp_path)
    path = where(results)
    change(path)
    out = tmp_path / "index.html"
    rc, err = run(argv(results, out), capsys)
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: {path}: differs from what the {stage} stage recorded"), err[0]
    assert err[0].endswith(f"-- fix: rerun it: snakemake --cores 1 publish --forcerun {stage}"), err[0]
    assert not out.exists() and not list(tmp_path.glob(".index.html*")), "no page (nor a temporary) is left"


def test_a_tsv_that_is_not_its_gates_is_refused(tmp_path, capsys):
    """Another recipe's (unchanged, sealed) TSV under this recipe's name: its digest is not the one
    this gate recorded."""
    results = linked_copy(tmp_path)
    lay = Layout(results, M)
    other = lay.gate_tsv("fp32").read_bytes()
    assert other != lay.gate_tsv("fp16").read_bytes()
    rewrite(lay.gate_tsv("fp16"), other)
    rc, err = run(argv(results, tmp_path / "index.html"), capsys)
    assert rc == 1 and err == [f"error: {lay.gate_tsv('fp16')}: differs from what the gate stage recorded -- fix: "
                               "rerun it: snakemake --cores 1 publish --forcerun gate"], err


def test_a_failed_gate_is_shown_fail_with_its_reason(tmp_path, capsys):
    """``<r>.failed.json`` and ``.failed.tsv``, written by the gate stage's own writer (as a failing
    gate leaves them under --keep-going), passed to the report by hand: FAIL and the reason."""
    lay = Layout(RESULTS, M)
    passed = records.read_gate(lay.gate_json("fp16"), tsv=True)
    result = {k: v for k, v in passed.items() if k not in (records.SEAL, "tsv")}
    reason = "max|dlogits| 0.0213 > 1e-09 <allowed>"
    result.update({"pass": False, "reasons": [reason]})
    with open(lay.gate_tsv("fp16"), newline="") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t"))
    failed_json, failed_tsv = tmp_path / "fp16.failed.json", tmp_path / "fp16.failed.tsv"
    gate.write_report(result, rows, failed_json, failed_tsv)
    assert failed_tsv.read_bytes() == lay.gate_tsv("fp16").read_bytes()
    assert records.read_gate(failed_json, tsv=True)["tsv"]["name"] == "fp16.failed.tsv"

    gates = [failed_json if r == "fp16" else lay.gate_json(r) for r in recipes()]
    tsvs = [failed_tsv if r == "fp16" else lay.gate_tsv(r) for r in recipes()]
    out = tmp_path / "index.html"
    rc, err = run(argv(RESULTS, out, gates, tsvs), capsys)
    assert rc == 0 and err == [], err
    page = records.read_report(out)
    rows_html = dict(re.findall(r'<tr data-recipe="([^"]+)">(.*?)</tr>', page, re.S))
    assert set(rows_html) == set(recipes())
    assert '<td data-key="pass" class="fail">FAIL</td>' in rows_html["fp16"]
    for r in set(recipes()) - {"fp16"}:
        assert '<td data-key="pass" class="pass">PASS</td>' in rows_html[r], r
    section = re.search(r'<section id="recipe-fp16".*?</section>', page, re.S).group(0)
    assert f'<li class="fail">{escape(reason)}</li>' in section
    # the failed gate's TSV is its own: without it among the inputs, the report says which is missing
    rc, err = run(argv(RESULTS, out, gates), capsys)
    assert rc == 1 and err == [f"error: {failed_json}: recipe fp16 has no gate TSV among the report's inputs -- fix: "
                               "pass every recipe's inputs (rules/report.smk lists them)"], err


@pytest.mark.parametrize("edit", ["verdict", "appended", "seal removed"])
def test_a_report_edited_after_its_stage_is_refused(tmp_path, edit):
    from recurrent_coreai.pipeline import dvc_record

    page = tmp_path / "report" / "index.html"
    page.parent.mkdir()
    shutil.copy2(Layout(RESULTS, M).base / "report" / "index.html", page)
    text = page.read_text(encoding="utf-8")
    if edit == "verdict":
        assert 'class="pass">PASS<' in text
        page.write_text(text.replace('class="pass">PASS<', 'class="pass">PASS!<', 1), encoding="utf-8")
        detail = ""
    elif edit == "appended":
        page.write_text(text + "<p>maintainer note</p>\n", encoding="utf-8")
        detail = ": it carries no digest from its stage"
    else:
        page.write_text(records.read_report(page), encoding="utf-8")
        detail = ": it carries no digest from its stage"
    expected = (f"{page}: differs from what the report stage recorded{detail} -- fix: rerun it: "
                "snakemake --cores 1 publish --forcerun report")
    with pytest.raises(records.PipelineError) as exc:
        records.verify_output(page)
    assert str(exc.value) == expected
    bad = dvc_record.unverified({"report-x": {"outs": [str(page)]}}, ["report-x"])
    assert list(bad) == ["report-x"] and str(bad["report-x"]) == expected
