"""Export recipes: the quantisation plan, recorded metadata, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from recurrent_coreai.stages import cli
from recurrent_coreai.coreai import convert
from recurrent_coreai.families.rwkv7 import FAMILY as RWKV7
from recurrent_coreai.stages import export
from recurrent_coreai.coreai import quantize
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.families.rwkv7.export_graph import RWKV7Decode
from recurrent_coreai.families.rwkv7.geometry import Geometry

TINY = Geometry(layers=2, hidden=128, head_dim=64, ffn=512, vocab=65536, decay_lora=16, a_lora=16, v_lora=16,
                gate_lora=32)


@pytest.fixture(scope="module")
def module():
    return RWKV7Decode(TINY, torch.float16)


def _actions(rows):
    return {r["layer"]: (r["action"], r["reason"]) for r in rows}


def test_int8keepproj_plan(cfg, module):
    rows = _actions(quantize.plan(module, cfg["recipes"]["int8keepproj"]["quantize"], "float16"))
    quantised = sorted(k for k, (a, _) in rows.items() if a == "int8")
    assert quantised == ["lm_head", "model.layers.0.ffn.key", "model.layers.0.ffn.value",
                         "model.layers.1.ffn.key", "model.layers.1.ffn.value"]
    assert rows["model.layers.1.attn.r_proj"] == ("fp16", "not matched by include")
    assert rows["model.layers.0.attn.w_lora.lora.0"][0] == "fp16"


def test_int8_everywhere_reports_layers_the_block_cannot_cover(cfg, module):
    rows = _actions(quantize.plan(module, cfg["recipes"]["int8"]["quantize"], "float16"))
    assert rows["model.layers.0.attn.r_proj"][0] == "int8"
    assert rows["model.layers.0.attn.g_lora.lora.2"][0] == "int8"           # input width 32
    assert rows["model.layers.1.attn.w_lora.lora.2"] == (
        "fp16", "input width 16 is not a multiple of block 32")            # coreai-opt would skip silently


def test_exclude_wins_over_include(module):
    q = {"bits": 4, "block_size": 32, "axis": 1, "include": [".*"], "exclude": [r".*\.o_proj"]}
    rows = _actions(quantize.plan(module, q, "float16"))
    assert rows["model.layers.0.attn.o_proj"] == ("fp16", "excluded by '.*\\\\.o_proj'")
    assert rows["lm_head"][0] == "int4"


def test_recipe_that_matches_nothing_is_an_error(module):
    q = {"bits": 8, "block_size": 4096, "axis": 1, "include": [".*"], "exclude": []}
    with pytest.raises(PipelineError, match=r"recipe odd: quantize.include .* matches no linear layer that can be quantised"):
        quantize.apply(module, q, "float16", export.example_inputs(), "odd")


def test_quantising_an_fp32_graph_is_refused(tiny_source, tmp_path):
    recipe = {"dtype": "float32", "quantize": {"bits": 8, "block_size": 32, "axis": 1, "include": ["lm_head"]}}
    with pytest.raises(PipelineError, match="only supported on a float16 graph"):
        export.export_recipe(RWKV7, tiny_source, "odd", recipe, "b", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_dtype_is_refused(tiny_source, tmp_path):
    with pytest.raises(PipelineError, match="dtype 'bfloat16' is not supported"):
        export.export_recipe(RWKV7, tiny_source, "odd", {"dtype": "bfloat16"}, "b", tmp_path / "out")


def test_unknown_recipe_on_the_command_line(tiny_source, tmp_path, capsys, repo_root):
    rc = cli.export(["--config-file", str(repo_root / "config.yaml"), "--model", "rwkv7-tiny", "--recipe", "int3",
                     "--source", str(tiny_source), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err == (f"error: {repo_root / 'config.yaml'}: unknown recipe 'int3' -- fix: use one of "
                               "['fp16', 'fp32', 'int4keepproj', 'int8', 'int8keepproj', 'int8keepstate']")


def test_conversion_error_is_one_line_and_leaves_nothing(tiny_source, tmp_path, monkeypatch, cfg):
    def boom(*args, **kwargs):
        raise RuntimeError("unsupported op aten::frobnicate\nlong traceback text")

    monkeypatch.setattr(export, "convert", boom)
    with pytest.raises(PipelineError) as exc:
        export.export_recipe(RWKV7, tiny_source, "fp32", cfg["recipes"]["fp32"], "b", tmp_path / "out")
    assert str(exc.value) == ("export fp32: conversion failed (RuntimeError: unsupported op aten::frobnicate) "
                              "-- fix: check the recipe; run with the pinned toolchain (make setup)")
    assert list(tmp_path.iterdir()) == []


def test_int4keepproj_export_records_the_plan(tiny_source, tmp_path, cfg):
    """One bundle, both entry points, built over the ONE quantised module: each function's graph
    holds the plan's quantised weights, and the weights are stored once (the prefill function adds
    a few graph ops, not a second copy of the fp16 weights)."""
    from recurrent_coreai.coreai.runtime import bundle_signature

    rec = export.export_recipe(RWKV7, tiny_source, "int4keepproj", cfg["recipes"]["int4keepproj"], "t-int4keepproj",
                               tmp_path / "out", chunk=16)
    on_disk = json.loads((tmp_path / "out" / "export.json").read_text())
    assert on_disk["bundle"] == "t-int4keepproj.aimodel" and (tmp_path / "out" / "t-int4keepproj.aimodel").is_dir()
    assert {r["layer"] for r in on_disk["quantized"]} == {r["layer"] for r in rec["quantized"]}
    assert all(r["action"] == "int4" for r in on_disk["quantized"]) and len(on_disk["quantized"]) == 5
    assert on_disk["states"] == {"recState": [2, 1, 2, 64, 64], "shiftState": [2, 1, 2, 128]}
    fns = on_disk["functions"]
    assert [(n, f["role"], f["tokens_per_call"]) for n, f in sorted(fns.items())] == [
        ("main", "decode", 1), ("prefill", "prefill", 16)]
    assert on_disk["prefill_chunk"] == 16 and on_disk["quantization_applies_to"] == ["main", "prefill"]
    for name, f in fns.items():
        assert f["state_writes"] == {"recState": 1, "shiftState": 1}, name
        assert f["quantized_weights"] == 5, name
        assert f["states"] == [{"name": "recState", "shape": [2, 1, 2, 64, 64], "dtype": "float16"},
                               {"name": "shiftState", "shape": [2, 1, 2, 128], "dtype": "float16"}], name
        assert f["outputs"] == [{"name": "logits", "shape": [1, 1, 65536], "dtype": "float16"}], name
    assert [(t["name"], t["shape"]) for t in fns["prefill"]["inputs"]] == [("input_ids", [1, 16]),
                                                                         ("position_ids", [1, 16])]
    held = bundle_signature(tmp_path / "out" / "t-int4keepproj.aimodel")      # what the saved asset says
    assert held == {n: {k: f[k] for k in ("inputs", "outputs", "states")} for n, f in fns.items()}
    ratio = on_disk["size_bytes"] / on_disk["size_bytes_decode_only"]
    assert 1.0 < ratio < 1.05, ratio
    meta = json.loads((tmp_path / "out" / "t-int4keepproj.aimodel" / "metadata.json").read_text())
    assert "1970" in meta["creationDate"] or meta["creationDate"].startswith("1970")


def test_an_int4_weight_is_packed_once_for_both_functions_and_freed(tiny_source, tmp_path, cfg):
    """coreai-torch packs each int4 weight into a new tensor per function; the export makes both
    functions use the first packing (of the data and of the zero points) and frees the unpacked
    int8 originals and each packed tensor
    once converted (1.5B int4keepproj: 4.23 -> see the README's scale table). The bundle is the
    same bytes as a conversion that frees nothing."""
    from recurrent_coreai.coreai.entrypoints import ENTRY_POINTS

    q = cfg["recipes"]["int4keepproj"]["quantize"]
    bundles, programs = {}, {}
    for release in (False, True):
        module, _, g = export.load_module(RWKV7, tiny_source, torch.float16, q, "int4keepproj")
        states = tuple(s.name for s in RWKV7.state_specs(g))
        traced = [convert.trace(e, RWKV7, module, 16, states) for e in ENTRY_POINTS]
        unpacked = {(n, b): getattr(m.parametrizations.weight[0], b) for n, m in module.named_modules()
                    if hasattr(m, "parametrizations") for b in ("quantized_data", "zero_point")}
        assert len(unpacked) == 10 and all(t.dtype == torch.int8 and t.numel() for t in unpacked.values())
        convert.save_functions(traced, tmp_path / str(release) / "b.aimodel", release=release)
        bundles[release] = (tmp_path / str(release) / "b.aimodel" / "main.mlirb").read_bytes()
        programs[release] = [t.program.state_dict for t in traced]
    assert bundles[True] == bundles[False]
    first, second = programs[True]
    packed = [k for k, v in first.items() if hasattr(v, "elem")]
    assert len(packed) == 10 and all(second[k] is first[k] for k in packed)     # data and zero points: once
    assert all(first[k].elem.numel() == 0 for k in packed)                     # freed once converted
    assert all(t.numel() == 0 for t in unpacked.values())                      # the int8 originals freed
    kept_first, kept_second = programs[False]
    assert all(kept_first[k].elem.numel() > 0 for k in packed)                 # without release: kept


class _TwoWrites(torch.nn.Module):
    """recState written twice in a row, shiftState through a view then whole."""

    def __init__(self):
        super().__init__()
        self.register_buffer("recState", torch.zeros(2, 3))
        self.register_buffer("shiftState", torch.zeros(2, 3))

    def forward(self, x):
        self.recState.copy_(torch.zeros_like(self.recState))
        self.recState.copy_(self.recState + x)      # traced onto the first copy's output
        self.shiftState[0].copy_(x[0])
        self.shiftState.copy_(self.shiftState * 2)
        return x * 2


def test_state_writes_counts_two_writes_in_a_row():
    ep = torch.export.export(_TwoWrites(), (torch.ones(2, 3),))
    assert convert.state_writes(ep, ("recState", "shiftState")) == {"recState": 2, "shiftState": 2}


def test_a_function_without_the_planned_quantised_weights_is_refused():
    layers = [{"layer": "lm_head", "action": "int8"}, {"layer": "x", "action": "fp16"}]
    convert.check_quantized({"main": {"quantized_weights": 1}, "prefill": {"quantized_weights": 1}}, layers, "q")
    with pytest.raises(PipelineError, match="function prefill holds 0 quantised weights, the plan has 1"):
        convert.check_quantized({"main": {"quantized_weights": 1}, "prefill": {"quantized_weights": 0}}, layers, "q")


FROZEN = """
import gc, weakref
from recurrent_coreai.coreai import convert

class Cycle:
    pass

assert gc.get_freeze_count() == 0
with convert.imports_frozen():
    frozen = gc.get_freeze_count()
    assert frozen > 100_000, frozen  # torch's, coreai-torch's, ... objects
    import sys
    # and what torch.export imports at its first call (else each collection walks ~140,000 more)
    assert {"torch._dynamo", "sympy", "networkx"} <= set(sys.modules), "torch.export's lazy imports not frozen"
    with convert.imports_frozen():  # inside: nothing more
        assert gc.get_freeze_count() == frozen
    made = Cycle()
    made.me = made
    gone = weakref.ref(made)
    del made
    gc.collect()
    assert gone() is None, "garbage made inside the block must still be collected"
assert gc.get_freeze_count() == 0
gc.freeze()  # a process that froze its imports itself: left as it is
with convert.imports_frozen():
    pass
assert gc.get_freeze_count() > 0
print("ok")
"""


def test_imports_frozen_freezes_what_was_there_collects_what_is_made_and_hands_it_back():
    """The export's collections between phases skip the imports' objects (frozen for the block);
    a cycle made inside the block is still collected, and after the block nothing stays frozen.
    In a process of its own: nothing frozen before it."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", FROZEN], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
