"""The toolchain contract (recurrent_coreai/coreai/tc.py, issue 38): one list of what the
pipeline needs of coreai-core/-torch/-opt, checked live (beta-watch, in the new venv) or statically
(the doctor stage); each miss one line saying what degrades."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from recurrent_coreai.coreai import contract as tc
from recurrent_coreai.coreai.toolchain import versions
from recurrent_coreai.coreai.reproducible import ASSUMPTIONS
from recurrent_coreai.util.errors import PipelineError

ROOT = Path(__file__).resolve().parents[1]


def test_the_contract_is_the_public_api_and_every_patched_internal():
    needs = tc.contract()
    assert needs[:len(tc.PUBLIC)] == list(tc.PUBLIC)
    assert [n.text for n in needs if n.kind == "internal"] == [a.text for a in ASSUMPTIONS]
    assert {n.package for n in needs} == {"coreai-core", "coreai-torch", "coreai-opt"}
    assert all(n.degrades for n in needs)


@pytest.mark.parametrize("live", [True, False], ids=["live", "static"])
def test_the_pinned_toolchain_holds_the_whole_contract(live):
    assert tc.check(live=live) == []


def test_docs_state_every_target_of_the_contract():
    text = (ROOT / "docs" / "toolchain.md").read_text()
    missing = [n.target for n in tc.contract() if f"`{n.target}`" not in text]
    assert not missing, f"docs/toolchain.md does not name {missing}"


def test_a_live_miss_is_one_line_saying_what_degrades(monkeypatch):
    import coreai_opt

    monkeypatch.delattr(coreai_opt, "ExportBackend")
    misses = tc.check(live=True)
    assert [(m["target"], m["why"], m["kind"]) for m in misses] == [
        ("coreai_opt:ExportBackend.CoreAI", "no attribute coreai_opt.ExportBackend", "public")]
    line = tc.miss_line(misses[0])
    assert line == (f"toolchain contract: coreai-opt {versions()['coreai-opt']}: no attribute "
                    f"coreai_opt.ExportBackend -- degrades: {tc.QUANT_FAILS}")


def test_two_entries_of_one_missing_module_are_one_line():
    """graph_builder:choice and graph_builder:_randomize_fn_name both miss as "no module …graph_builder"."""
    def m(target, why):
        return {"package": "coreai-core", "version": "1.0.0b2", "target": target, "why": why, "degrades": "d"}
    misses = [m("a:choice", "no module a"), m("b:choice", "no module b"), m("a:_randomize_fn_name", "no module a")]
    assert tc.miss_lines(misses) == [tc.miss_line(misses[0]), tc.miss_line(misses[1])]


def test_a_changed_internal_is_a_live_miss(monkeypatch):
    import coreai.authoring.asset as asset

    monkeypatch.setattr(asset, "_CURRENT_BYTECODE_VERSION", 7)
    misses = tc.check(live=True)
    assert [m["target"] for m in misses] == ["coreai.authoring.asset:_CURRENT_BYTECODE_VERSION"]
    assert misses[0]["why"].startswith("changed: NOT TRUE ANY MORE:") and misses[0]["bytes"] is True


@pytest.fixture
def fake_package(tmp_path, monkeypatch) -> str:
    """A package on disk the static check reads (never imported): a class, a re-export, a star
    import, a module __getattr__, a compiled-only submodule (stubs)."""
    root = tmp_path / "fakecoreai_pkg"
    (root / "inner").mkdir(parents=True)
    (root / "native").mkdir()
    (root / "native" / "__init__.pyi").write_text("def f(): ...\n")
    (root / "__init__.py").write_text("from .inner.mod import Thing as Exported\nfrom .star import *\n"
                                      "raise RuntimeError('the static check must not import this')\n")
    (root / "star.py").write_text("def starred(): pass\n")
    (root / "inner" / "__init__.py").write_text("")
    (root / "inner" / "mod.py").write_text(
        "import os\nVALUE = 1\nclass Thing:\n    class Mode:\n        RELEASE = 1\n    def method(self): pass\n"
        "class Child(Thing):\n    pass\ntry:\n    from os import sep\nexcept ImportError:\n    sep = '/'\n")
    (root / "lazy.py").write_text("def __getattr__(name):\n    return name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fakecoreai_pkg"


@pytest.mark.parametrize("target,why", [
    ("{p}.inner.mod:Thing.Mode.RELEASE", None),
    ("{p}.inner.mod:Thing.method", None),
    ("{p}.inner.mod:VALUE", None),
    ("{p}.inner.mod:sep", None),
    ("{p}:Exported.method", None),
    ("{p}:starred", None),
    ("{p}.inner.mod:Child.method", None),  # maybe inherited: not a miss
    ("{p}.lazy:anything", None),  # a module __getattr__: cannot be told
    ("{p}.native:whatever", None),  # compiled: cannot be told
    ("{p}.inner.mod:Thing.gone", "no attribute {p}.inner.mod.Thing.gone"),
    ("{p}.inner.mod:Gone", "no attribute {p}.inner.mod.Gone"),
    ("{p}:Exported.gone", "no attribute {p}.inner.mod.Thing.gone"),
    ("{p}.inner.gone", "no module {p}.inner.gone"),
    ("{p}:nothing", "no attribute {p}.nothing"),
])
def test_the_static_check_reads_files_and_imports_nothing(fake_package, target, why):
    assert tc.static_missing(target.format(p=fake_package)) == (why and why.format(p=fake_package))
    assert fake_package not in sys.modules


def test_the_command_prints_the_misses_as_json():
    proc = subprocess.run([sys.executable, "-m", "recurrent_coreai.coreai.contract", "--static", "--json"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["misses"] == [] and got["checked"] == len(tc.contract())
    assert got["versions"]["coreai-core"] == versions()["coreai-core"]


def test_doctor_warns_one_line_per_miss_and_records_them(monkeypatch, tmp_path, caplog):
    from recurrent_coreai.pipeline.records import read_doctor
    from recurrent_coreai.stages import doctor

    gone = tc.Need("coreai.authoring.gone:Thing", "a test", "something degrades")
    monkeypatch.setattr(tc, "PUBLIC", (*tc.PUBLIC, gone))
    caplog.set_level(logging.WARNING)
    out = tmp_path / "x.doctor.json"
    doctor.doctor_bundle([], None, None, out)
    lines = [r.getMessage() for r in caplog.records if "toolchain contract" in r.getMessage()]
    assert lines == [f"toolchain contract: coreai-core {versions()['coreai-core']}: no module "
                     "coreai.authoring.gone -- degrades: something degrades"]
    assert [m["target"] for m in read_doctor(out)["toolchain_contract"]] == ["coreai.authoring.gone:Thing"]


def test_doctor_records_nothing_when_the_contract_holds(tmp_path):
    from recurrent_coreai.pipeline.records import read_doctor
    from recurrent_coreai.stages import doctor

    doctor.doctor_bundle([], None, None, tmp_path / "x.doctor.json")
    assert "toolchain_contract" not in read_doctor(tmp_path / "x.doctor.json")


def test_beta_watch_checks_the_contract_in_the_new_venv(tmp_path, capsys):
    from recurrent_coreai.tools.beta_watch.contract import check_contract

    env = {"PATH": "/usr/bin:/bin"}
    assert check_contract(sys.executable, ROOT, env) == []
    assert f"{len(tc.contract())}/{len(tc.contract())} hold" in capsys.readouterr().out
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named coreai' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(PipelineError, match="cannot check the toolchain contract with the new versions: "
                                            "ModuleNotFoundError: No module named coreai"):
        check_contract(str(broken), ROOT, env)


def test_the_dry_run_warns_when_the_baseline_is_not_built():
    from recurrent_coreai.tools.beta_watch.cli import unbuilt
    from recurrent_coreai.tools.beta_watch.jobs import Job

    assert unbuilt(ROOT, "results", []) is None
    jobs = [Job("source", (("model", "m"),)), Job("vocab", (("model", "m"),)), Job("reference", (("model", "m"),)),
            Job("toolchain")]
    line = unbuilt(ROOT, "results", jobs)
    assert line.startswith(f"warning: {ROOT / 'results'}: the baseline is not built (snakemake -n publish plans "
                           "4 job(s): source[model=m], vocab[model=m], reference[model=m] …)")
    assert "\n" not in line


def test_an_export_whose_states_became_plain_inputs_is_refused_in_one_line():
    """coreai-torch 0.4.2 + coreai-core 1.0.0b2 (measured) make the states plain inputs and outputs."""
    from recurrent_coreai.stages.export import check_states_kept

    def t(name):
        return {"name": name, "shape": [1], "dtype": "float16"}

    kept = {"main": {"inputs": [t("input_ids")], "outputs": [t("logits")], "states": [t("recState"), t("shiftState")]}}
    check_states_kept(kept, ("recState", "shiftState"), "fp16")
    io = {"main": {"inputs": [t("recState"), t("shiftState"), t("input_ids")], "outputs": [t("logits")], "states": []}}
    with pytest.raises(PipelineError) as err:
        check_states_kept(io, ("recState", "shiftState"), "fp16")
    assert str(err.value).startswith(f"export fp16: coreai-torch {versions()['coreai-torch']} (coreai-core ")
    assert "made function 'main' hold states [], not ['recState', 'shiftState'] (recState, shiftState became plain " \
           "inputs and outputs) -- fix: install a toolchain that keeps them Core AI states" in str(err.value)
