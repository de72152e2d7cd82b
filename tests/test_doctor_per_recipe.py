"""coreai doctor's findings judged per recipe (stages/doctor.py): a block-divisibility finding
(QUANT-BLOCK-DIVISIBILITY, e.g. Mamba-2's padded vocab_size 50288, not a multiple of 32) fails the
doctor stage only for a recipe that quantises a tensor with that dimension; for fp16 (nothing
quantised) or a recipe that keeps the head it is kept in the JSON as not applicable, with why.

Runs coreai doctor (coreai-cli) on a small Mamba-2 whose vocabulary is not a multiple of 32, in
the state-spaces layout (vocab_size 1030 padded to 1040 by pad_vocab_size_multiple 16, as 50280
-> 50288), and on the normal-form config.json of the shipped mamba2-1.3b-shape (never built here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from recurrent_coreai import families
from recurrent_coreai.coreai import quantize
from recurrent_coreai.stages import doctor

pytest.importorskip("coreai_cli")
ROOT = Path(__file__).resolve().parents[1]
MAMBA2 = families.get("mamba2")
SHAPE = {"layers": 2, "hidden": 64, "d_state": 16, "headdim": 16, "vocab": 1040, "n_groups": 2, "tie_embeddings": True}
FP16 = {"dtype": "float16"}
# quantises the (tied) head by a raw include, and the out_proj linears: the head has the odd vocab dimension
HEAD = {"dtype": "float16", "quantize": {"bits": 8, "block_size": 32, "axis": 1,
                                         "include": ["lm_head", r"backbone\.layers\.\d+\.mixer\.out_proj"]}}


def block_findings(result: dict) -> list[dict]:
    return [f for r in result["reports"] for f in r["findings"] if f["id"] == doctor.BLOCK_RULE]


def plan_record(recipe: str, spec: dict, geom) -> dict:
    """What export.json says of a recipe's plan (recipe, recipe_spec, quantized), from the skeleton."""
    q = spec.get("quantize")
    if not q:
        return {"recipe": recipe, "recipe_spec": spec, "quantized": []}
    q = quantize.resolve_roles(q, MAMBA2.roles, recipe, MAMBA2.tied_linears(geom))
    rows = quantize.plan(MAMBA2.decode_skeleton(geom, torch.float16), q, "float16")
    return {"recipe": recipe, "recipe_spec": spec, "quantized": [r for r in rows if r["action"].startswith("int")]}


def test_only_a_block_finding_is_judged_and_only_by_the_quantised_shapes():
    finding = {"id": doctor.BLOCK_RULE, "evidence": "not divisible by block size 32: vocab_size=50280"}
    spec = {"recipe_spec": HEAD}   # block 32
    head = {"recipe": "h", **spec, "quantized": [{"layer": "lm_head", "shape": [50288, 2048]}]}   # padded rows
    proj = {"recipe": "p", **spec, "quantized": [{"layer": "a.out_proj", "shape": [2048, 4096]},
                                                 {"layer": "b.out_proj", "shape": [2048, 4096]}]}
    # the head's blocks run along its 2048 inputs (axis 1): its 50288 rows need no block (issue 34, case 9)
    assert doctor.not_applicable(finding, head) == (
        "recipe h quantises 1 linear in blocks of 32 along axis 1, where each is a multiple of the block "
        "(50288x2048); the other axis needs none: vocab_size=50280 does not apply")
    gdn = {"recipe": "int8keepstate", **spec, "quantized": [{"layer": "lm_head", "shape": [1000, 128]}]}
    assert doctor.not_applicable(finding, gdn).startswith("recipe int8keepstate quantises 1 linear in blocks of 32")
    assert doctor.not_applicable(finding, {"recipe": "fp16", "recipe_spec": FP16, "quantized": []}) == (
        "recipe fp16 quantises no tensor, so no block size applies to vocab_size=50280")
    assert doctor.not_applicable(finding, proj) == ("recipe p quantises 2 linears in blocks of 32 along axis 1, where "
                                                    "each is a multiple of the block (2048x4096); the other axis needs "
                                                    "none: vocab_size=50280 does not apply")
    rows_only = {**proj, "quantized": [{"layer": "x", "shape": [96, 2048]}]}    # 96 rows: no block runs along them
    assert doctor.not_applicable(finding, rows_only) is not None
    block64 = {**proj, "recipe_spec": {"quantize": {**HEAD["quantize"], "block_size": 64}},
               "quantized": [{"layer": "x", "shape": [2048, 96]}]}
    assert doctor.not_applicable(finding, block64) is None          # 96 is not a multiple of 64
    assert doctor.not_applicable({**finding, "id": "SRC-F-NORMALIZE"}, {"recipe": "fp16", "quantized": []}) is None
    assert doctor.not_applicable(finding, None) is None  # no export: judged as coreai doctor rates it


@pytest.mark.parametrize("recipe", ["fp16", "int8keepstate"])
def test_the_shipped_mamba2_1_3b_shape_passes_the_doctor(recipe, tmp_path):
    """Its normal-form config.json (what the doctor reads of the source stage's output): vocab_size
    50288 is flagged silent by coreai doctor, and judged not applicable for both its recipes."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    model = cfg["models"]["mamba2-1.3b-shape"]
    assert recipe in model["recipes"]
    geom = MAMBA2.geometry_from_shape(model["source"]["shape"], "config.yaml")
    (tmp_path / "config.json").write_text(json.dumps(MAMBA2.config_json(geom)))
    record = plan_record(recipe, cfg["recipes"][recipe], geom)
    status, report = doctor.run_doctor(tmp_path)
    report["exit_status"] = status
    assert status == doctor.FAIL_STATUS            # as coreai doctor rates it: silent
    assert doctor.judge(report, record) < doctor.FAIL_STATUS
    (found,) = [f for f in report["findings"] if f["id"] == doctor.BLOCK_RULE]
    assert "vocab_size=50288" in found["evidence"] and found["applies"] is False
    assert found["not_applicable"].startswith(f"recipe {recipe} quantises ")
    assert report["doctor_exit_status"] == doctor.FAIL_STATUS
    # the same checkpoint with a recipe that quantises the head (50288 x 2048): its blocks run along
    # the 2048 inputs, so the vocabulary's 50288 does not apply either (issue 34, case 9)
    head = plan_record("head", HEAD, geom)
    assert any(r["layer"] == "lm_head" for r in head["quantized"])
    status, report = doctor.run_doctor(tmp_path)
    report["exit_status"] = status
    assert doctor.judge(report, head) < doctor.FAIL_STATUS
    # a hand-made plan quantising a linear whose input width is not a multiple of the block: applies
    odd = {**head, "quantized": [{"layer": "lm_head", "shape": [50288, 2050]}]}
    status, report = doctor.run_doctor(tmp_path)
    report["exit_status"] = status
    assert doctor.judge(report, odd) == doctor.FAIL_STATUS


@pytest.fixture(scope="module")
def state_spaces_exports(tmp_path_factory, cfg):
    """A small Mamba-2 in the state-spaces layout (config.json vocab_size 1030, padded to 1040),
    normalised by the source stage, exported as fp16 and as HEAD: built once per session for this
    file and tests/test_doctor_derived.py (repo_copies.shared_build). Read-only here: the tests
    write their doctor.json elsewhere (tests/test_doctor_derived.py's, once, beside it)."""
    pytest.importorskip("coreai_torch")
    from repo_copies import shared_build

    return shared_build(tmp_path_factory, "padded-mamba2", lambda root: _padded_exports(root, cfg))[0]


def _padded_exports(root: Path, cfg: dict) -> dict:
    """Builds into ``root``; returns shared_build's record (nothing to record)."""
    from recurrent_coreai.stages import export
    from recurrent_coreai.stages.source import build_source

    synthetic = root / "synthetic"
    model = {"family": "mamba2", "license": "apache-2.0",
             "source": {"kind": "synthetic", "seed": 5, "layout": "mamba-ssm", "shape": SHAPE}}
    build_source("padded", model, cfg["vocab"], synthetic)
    ckpt = root / "state-spaces"
    MAMBA2.write_synthetic(MAMBA2.geometry_from_shape(SHAPE, "test"), 5, ckpt, "mamba-ssm")
    conf = json.loads((ckpt / "config.json").read_text())
    assert conf["vocab_size"] == 1040
    conf.update(vocab_size=1030, pad_vocab_size_multiple=16)   # as state-spaces/mamba2-*: 50280 -> 50288
    (ckpt / "config.json").write_text(json.dumps(conf))
    shutil.copyfile(synthetic / "tokenizer.json", ckpt / "tokenizer.json")
    source = root / "source"
    build_source("padded", {**model, "source": {"kind": "path", "path": str(ckpt)}}, cfg["vocab"], source)
    assert json.loads((source / "manifest.json").read_text())["geometry"]["vocab"] == 1040   # the table's rows
    patch = pytest.MonkeyPatch()
    patch.setattr(export, "DECODE_ONLY_MAX_PARAMS", 0)   # no second, decode-only conversion
    for recipe, spec in (("fp16", FP16), ("head", HEAD)):
        export.export_recipe(MAMBA2, source, recipe, spec, f"padded-{recipe}", root / "export" / recipe, chunk=16)
    patch.undo()
    return {}


def test_fp16_of_a_padded_vocab_passes_and_records_the_finding_as_not_applicable(state_spaces_exports, tmp_path):
    root, out = state_spaces_exports, tmp_path / "fp16.doctor.json"
    sources = [ROOT / s for s in MAMBA2.doctor_sources()]
    result = doctor.doctor_bundle(sources, root / "source", root / "export" / "fp16", out)
    assert result["exit_status"] < doctor.FAIL_STATUS and out.is_file()
    written = json.loads(out.read_text())
    (found,) = block_findings(written)
    # coreai doctor reads the config.json the source stage keeps: the unpadded vocab_size, as state-spaces writes it
    assert found["severity"] == "silent" and "vocab_size=1030" in found["evidence"]
    assert found["applies"] is False
    assert found["not_applicable"] == "recipe fp16 quantises no tensor, so no block size applies to vocab_size=1030"
    assert written["not_applicable"] == 1 and written["exit_status"] == result["exit_status"]
    checkpoint = next(r for r in written["reports"] if r["kind"] == "checkpoint")
    assert checkpoint["doctor_exit_status"] == doctor.FAIL_STATUS and checkpoint["exit_status"] < doctor.FAIL_STATUS


def test_a_recipe_quantising_the_padded_head_passes_its_blocks_run_along_the_inputs(state_spaces_exports, tmp_path):
    """HEAD quantises the 1040 x 64 head in blocks of 32 along its 64 inputs: the vocabulary's 1030
    rows need no block (issue 34, case 9: a gdn's 1000-row head failed int8keepstate), so the
    finding is recorded as not applicable and the stage passes."""
    root, out = state_spaces_exports, tmp_path / "head.doctor.json"
    sources = [ROOT / s for s in MAMBA2.doctor_sources()]
    result = doctor.doctor_bundle(sources, root / "source", root / "export" / "head", out)
    assert result["exit_status"] < doctor.FAIL_STATUS and out.exists()
    (found, *_) = block_findings(result)
    assert "not divisible by block size 32: vocab_size=1030" in found["evidence"] and found["applies"] is False
    assert "in blocks of 32 along axis 1" in found["not_applicable"]


def test_a_plan_quantising_an_input_width_off_the_block_fails_with_one_line(state_spaces_exports):
    """A plan whose quantised linear has an input width that is not a multiple of the block (a
    hand-made export record: the quantiser keeps such a linear) fails with coreai doctor's line."""
    root = state_spaces_exports
    sources = [ROOT / s for s in MAMBA2.doctor_sources()]
    odd = {"recipe": "odd", "recipe_spec": HEAD, "quantized": [{"layer": "lm_head", "shape": [1040, 66]}]}
    result = doctor.lint(sources, root / "source", None, odd)
    assert result["exit_status"] == doctor.FAIL_STATUS
    line = doctor.error_line(result)
    assert line.startswith(f"error: {root / 'source' / 'config.json'}: coreai doctor {doctor.BLOCK_RULE} (silent): ")
    assert "not divisible by block size 32: vocab_size=1030" in line and line.count(" -- fix: ") == 1
    assert "applies" not in block_findings(result)[0]