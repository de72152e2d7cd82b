"""Degrade, never die (issue 38): on a coreai where a reproducible-build patch's target is gone
(coreai-core 1.0.0b2 has no ``coreai.authoring.graph_builder`` / ``func`` and no
``AIModelAsset._write_odix``), the patch is skipped, the export still runs, its record says that
the bundle is not byte-reproducible and why, and the run logs ONE warning line naming what is
missing. Targets are removed here by monkeypatching the installed (pinned) coreai."""

from __future__ import annotations

import json
import logging
import re
import secrets
import sys
from pathlib import Path

import pytest

from recurrent_coreai.coreai import reproducible
from recurrent_coreai.coreai.reproducible import patches

LOGGER = patches.__name__


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    """Each test sees its own 'once per run' (the set of misses already warned about)."""
    monkeypatch.setattr(patches, "_warned", set())


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def drop_module(monkeypatch, name: str) -> None:
    """As if the installed coreai had no module ``name`` (it was imported before: the objects that
    use it keep working, a fresh import of it fails with ModuleNotFoundError)."""
    __import__(name)
    monkeypatch.setitem(sys.modules, name, None)


def test_a_missing_module_skips_only_its_patch_with_one_warning(monkeypatch, caplog):
    import coreai.authoring.func as func
    import coreai.authoring.graph_builder as gb

    drop_module(monkeypatch, "coreai.authoring.func")
    caplog.set_level(logging.WARNING, LOGGER)
    with reproducible.collect_misses() as found:
        for _ in range(2):  # an export enters the scope twice (decode alone, then every function)
            with reproducible.export_scope("x"):
                assert gb.choice is not secrets.choice  # the other patches are made
                assert func.choice is secrets.choice  # the skipped one is not
    assert gb.choice is secrets.choice
    assert [(m["target"], m["why"], m["bytes"]) for m in found] == [
        ("coreai.authoring.func:choice", "no module coreai.authoring.func", True)]
    lines = warnings_of(caplog)
    assert len(lines) == 1, lines
    assert "no module coreai.authoring.func" in lines[0] and "not byte-reproducible" in lines[0]
    assert "\n" not in lines[0] and "Traceback" not in lines[0] and "check the recipe" not in lines[0]


def test_a_missing_attribute_is_a_miss_not_an_error(monkeypatch, caplog):
    import coreai.authoring.metal as metal

    monkeypatch.delattr(metal, "choice")
    caplog.set_level(logging.WARNING, LOGGER)
    with reproducible.collect_misses() as found, reproducible.export_scope("x"):
        assert not hasattr(metal, "choice")
    assert [m["why"] for m in found] == ["no attribute coreai.authoring.metal.choice"]
    assert len(warnings_of(caplog)) == 1


def test_a_changed_internal_skips_its_patch(monkeypatch):
    """The target is there but no longer what the patch relies on: skipped too (a swap of a changed
    internal could break the export)."""
    import coreai.authoring.asset as asset

    original = asset._serialize_module_to_bytecode
    monkeypatch.setattr(asset, "_CURRENT_BYTECODE_VERSION", 7)
    with reproducible.collect_misses() as found, reproducible.export_scope("x"):
        assert asset._serialize_module_to_bytecode is original  # resource names not canonicalised
        assert not isinstance(asset.hashlib, reproducible.ChunkedHashlib)  # it hashes what that writer wrote
    assert [m["why"] for m in found] == [f"changed: NOT TRUE ANY MORE: {a.text}" for a in reproducible.ASSUMPTIONS
                                         if "version 6" in a.text]


def test_lowering_without_write_odix_keeps_coreai_s_serializer(monkeypatch, caplog):
    import coreai.authoring.asset as asset

    before = asset.serialize_module_to_odix
    monkeypatch.delattr(asset.AIModelAsset, "_write_odix")
    caplog.set_level(logging.WARNING, LOGGER)
    with reproducible.collect_misses() as found, reproducible.lowering_scope():
        assert asset.serialize_module_to_odix is before
    assert [m["why"] for m in found] == ["no attribute coreai.authoring.asset.AIModelAsset._write_odix"]
    assert ".odix" in warnings_of(caplog)[0]


def test_memory_only_patch_missing_keeps_the_bundle_byte_reproducible(monkeypatch):
    from recurrent_coreai.coreai import contract
    import coreai_torch.converter as conv

    monkeypatch.delattr(conv, "get_target")
    with reproducible.collect_misses() as found, reproducible.constants_released():
        pass
    assert [m["bytes"] for m in found] == [False]
    assert contract.degraded_fields(found)["byte_reproducible"] is True
    assert contract.degraded_fields([]) == {}


def test_the_export_runs_and_its_record_says_it_is_not_byte_reproducible(monkeypatch, caplog, tiny_source, tmp_path,
                                                                         cfg):
    """The whole export stage on a coreai without coreai.authoring.graph_builder's module as a
    patch site: it succeeds, export.json says which assumption failed, one warning line."""
    from recurrent_coreai import families
    from recurrent_coreai.pipeline.records import read_export
    from recurrent_coreai.stages import export

    import coreai_torch  # noqa: F401 - everything the conversion imports is loaded before the module goes
    import coreai.authoring.asset  # noqa: F401

    drop_module(monkeypatch, "coreai.authoring.func")
    caplog.set_level(logging.WARNING)
    out = tmp_path / "fp16"
    rec = export.export_recipe(families.get("rwkv7"), tiny_source, "fp16", cfg["recipes"]["fp16"],
                               "rwkv7-tiny-fp16", out)
    on_disk = read_export(out)
    assert (out / on_disk["bundle"] / "main.mlirb").is_file()
    for r in (rec, on_disk):
        assert r["byte_reproducible"] is False
        assert [(m["target"], m["why"]) for m in r["toolchain_misses"]] == [
            ("coreai.authoring.func:choice", "no module coreai.authoring.func")]
        assert r["toolchain_misses"][0]["assumption"].startswith("coreai.authoring.func draws its random name")
    lines = [r.getMessage() for r in caplog.records if "coreai.authoring.func" in r.getMessage()]
    assert len(lines) == 1 and re.search(r"coreai-core \S+: no module coreai\.authoring\.func -- so op-name", lines[0])


PROVENANCE = re.compile(r"<!-- provenance begin -->\n(.*?)<!-- provenance end -->", re.S)


def test_the_card_says_which_bundle_is_not_byte_reproducible_and_why():
    """The card template's provenance block (the report previews the card) with one degraded recipe."""
    import jinja2

    template = (Path(reproducible.__file__).parents[2] / "stages" / "templates" / "model_card.md.j2").read_text()
    block = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(PROVENANCE.search(template).group(1))
    miss = {"package": "coreai-core", "version": "1.0.0b2", "why": "no module coreai.authoring.graph_builder"}
    note = {"package": "coreai-torch", "version": "0.4.2", "why": "left the states s as plain arguments",
            "degrades": "the export promoted them"}
    recipes = [{"bundle": "m-fp16", "gate": {"bundle_sha256": "a" * 64}, "byte_reproducible": False,
                "toolchain_misses": [miss], "toolchain_notes": []},
               {"bundle": "m-fp32", "gate": {"bundle_sha256": "b" * 64}, "byte_reproducible": True,
                "toolchain_misses": [], "toolchain_notes": [note]}]
    text = block.render(source={"uri": "synthetic://x", "revision": None}, normal_layout="fla", weights_sha256="c",
                        toolchain={"coreai-core": "1.0.0b2"}, build_date=None, recipes=recipes)
    lines = [line for line in text.splitlines() if "byte-reproducible" in line]
    assert lines == ["- **`m-fp16` is not byte-reproducible**: its toolchain lacks what the reproducible-build "
                     "patches need (coreai-core 1.0.0b2: no module coreai.authoring.graph_builder), so a rebuild may "
                     "differ in its bytes, not in its gate numbers"]
    # what the export did instead at no cost in bytes (convert.promote_states): said, the bundle still reproducible
    assert [line for line in text.splitlines() if "coreai-torch 0.4.2" in line] == [
        "- `m-fp32`: coreai-torch 0.4.2 left the states s as plain arguments, so the export promoted them; gated as "
        "every bundle is"]


def test_the_beta_report_calls_a_degraded_digest_not_comparable():
    from recurrent_coreai.tools.beta_watch import report

    assert report.digests("a" * 64, "a" * 64) == f"`{'a' * 12}` (unchanged)"
    assert report.digests("a" * 64, "b" * 64) == f"`{'a' * 12}` → `{'b' * 12}`"
    assert report.digests("a" * 64, "b" * 64, comparable=False).endswith("(not comparable: not byte-reproducible)")
    side = {k: None for k in ("pass", "agree_counted", "counted", "max_abs_dlogits", "mean_kl", "kld_p99",
                              "same_top1", "ppl_ratio", "size_bytes", "export_seconds", "export_peak_rss_mb")}
    old = side | {"pass": True, "bundle_sha256": "a" * 64, "byte_reproducible": False,
                  "toolchain_misses": ["no module coreai.authoring.graph_builder"]}
    new = side | {"pass": True, "bundle_sha256": "b" * 64, "byte_reproducible": True, "toolchain_misses": []}
    miss = {"package": "coreai-core", "version": "1.0.0b3", "why": "no module x", "degrades": "something"}
    md = report.render_markdown({
        "updates": {"coreai-core": {"old": "1.0.0b2", "new": "1.0.0b3"}}, "verdict": "no regression",
        "limits": {"max_agree_drop": 0.0}, "index_url": None, "rebuild_seconds": 1.0,
        "jobs": {"executed": [], "summary": [], "failed": []}, "toolchain": {"old": {}, "new": {}},
        "recipes": [{"model": "m", "recipe": "fp16", "old": old, "new": new}], "regressions": [],
        "contract": {"new": [miss]}})
    assert "(not comparable: not byte-reproducible)" in md and "(unchanged)" not in md
    assert "- toolchain contract: coreai-core 1.0.0b3: no module x -- degrades: something" in md
    assert ("- m/fp16 (old): not byte-reproducible (no module coreai.authoring.graph_builder); its digest is not "
            "comparable") in md
    json.dumps(old)  # the numbers stay JSON (the .json report)
