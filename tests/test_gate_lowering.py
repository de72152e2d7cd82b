"""The gate's lowering with the Linux runtime's repeated work on constants done once
(stages/gate_lowering.py, coreai/constant_fold.py): a quantised bundle's dequantisation evaluated
once, an fp32 bundle's matmuls by a large constant run on that constant stored transposed; trusted
only after it agrees bit for bit with the aot stage's lowering, and the aot stage's lowering run
instead whenever it does not.

* :func:`dequantise` against a per-element loop of ``scale * (q - offset1) + offset2``;
* on the shared build's rwkv7-trained int8keepproj bundle: the folded lowering is used, every gated
  row equals the aot stage's lowering's (the runtime's own dequantisation is the independent
  side), the scratch lowering is gone afterwards, and the build's gate JSON and card say so;
* a folded lowering that differs in one bit, or a fold that fails, is not used, and the record
  says why; an fp16 bundle with a 256-id head (its linears are small conv2d) has nothing to fold
  and runs the aot lowering;
* on the shared build's rwkv7-tiny fp32 and fp16 bundles (a 65536-row head): the folded lowering
  moves the head's matmul (fp32) or 1 x 1 convolution (fp16, run as an fp32 matmul rounded once)
  in both functions, and its logits and states over a prompt and a generated stream are bit for
  bit the aot stage's lowering's; the build's gates ran it, the int8keepproj one too (its head,
  dequantised, is an fp16 convolution).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from recurrent_coreai.coreai.constant_fold import MATMUL_MIN, dequantise
from recurrent_coreai.coreai.fold_words import describe
from recurrent_coreai.coreai.runtime import PromptSession
from recurrent_coreai.pipeline import config
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.stages import gate, gate_lowering

MODEL = "rwkv7-trained"  # rwkv7 int8keepproj; its 256-id head makes a runtime call ~7x cheaper than rwkv7-tiny's 65536


def test_dequantise_is_the_blockwise_formula_rounded_once():
    rng = np.random.default_rng(0)
    q = rng.integers(-128, 128, (6, 8), dtype=np.int8)
    scale = rng.uniform(1e-3, 2e-2, (6, 2)).astype(np.float16)  # blocks of 4 along axis 1
    off1 = rng.integers(-3, 3, (6, 2)).astype(np.int8)
    off2 = rng.uniform(-1e-2, 1e-2, (6, 2)).astype(np.float16)
    want = np.empty(q.shape, np.float16)
    for i in range(6):
        for j in range(8):
            b = j // 4
            want[i, j] = np.float16(np.float32(scale[i, b]) * (np.float32(q[i, j]) - np.float32(off1[i, b]))
                                    + np.float32(off2[i, b]))
    got = dequantise(q, scale, off1, off2)
    assert got.dtype == np.float16 and got.tobytes() == want.tobytes()
    with pytest.raises(ValueError, match="does not tile"):
        dequantise(q, scale[:, :1].repeat(3, axis=1), off1, off2)


def _inputs(tiny_results, recipe, model=MODEL):
    lay = Layout(tiny_results, model)
    cfg = config.load(tiny_results.parent / "config.yaml")  # the build's own
    settings = config.gate_settings(config.settings(cfg, "gate", model=model, recipe=recipe), recipe)
    inputs = gate.gate_inputs(model, recipe, lay.export(recipe), lay.aot("universal", recipe), lay.reference, settings)
    return lay, settings, inputs


def test_a_quantised_gate_runs_the_folded_lowering_and_gets_the_aot_lowerings_rows(tiny_results, tmp_path):
    lay, settings, inputs = _inputs(tiny_results, "int8keepproj")
    shipped, shipped_rows = gate.run_gate(inputs["aimodelx"], inputs["record"], inputs["stream"], settings)
    out = tmp_path / "int8keepproj.json"
    with gate_lowering.gate_lowering(inputs, out) as (lowering, ran):
        assert lowering != inputs["aimodelx"] and lowering.parent.parent == tmp_path
        assert lowering.parent.name.startswith(".int8keepproj.json.") and lowering.parent.name.endswith(".tmp")
        folded, folded_rows = gate.run_gate(lowering, inputs["record"], inputs["stream"], settings)
    assert not lowering.exists() and list(tmp_path.iterdir()) == []
    assert ran["ran"] == gate_lowering.FOLDED and ran["bit_identical"] is True
    assert ran["checked_calls"] == 1 + gate_lowering.FOLD_CHECK_DECODE
    assert ran["folded_ops"] == 2 * ran["distinct_weights"] > 0  # main and prefill share each weight's array
    assert gate.tsv_text(folded_rows) == gate.tsv_text(shipped_rows)
    assert folded == shipped
    # the build ran it too: its gate record and card say so
    built = json.loads(lay.gate_json("int8keepproj").read_text())
    assert [r["ran"] for r in built["lowering_runs"]] == [gate_lowering.FOLDED]
    assert built["lowering_runs"][0]["odix_sha256"] == ran["odix_sha256"]  # the fold is byte-reproducible
    assert gate.tsv_text(folded_rows) == lay.gate_tsv("int8keepproj").read_text()
    card = lay.card.read_text()
    assert "int8 dequantisation evaluated once instead of on every call, bit-identical to the aot stage's lowering on 3 calls" in card


class _OneBitOff(PromptSession):
    """The folded lowering's logits one ulp away in every decode call."""

    def step(self, token):
        logits = super().step(token)
        if ".tmp" in str(self.aimodelx):
            logits = logits.copy()
            logits[7] = np.nextafter(logits[7], np.inf)
        return logits


def test_a_folded_lowering_off_by_one_bit_is_not_run(tiny_results, tmp_path):
    _, _, inputs = _inputs(tiny_results, "int8keepproj")
    with gate_lowering.gate_lowering(inputs, tmp_path / "g.json", session_factory=_OneBitOff) as (lowering, ran):
        assert lowering == inputs["aimodelx"]
    assert ran == {"ran": gate_lowering.PIPELINE, "fold_refused": ran["fold_refused"]}
    assert ran["fold_refused"].startswith("call 2 of 3: logits differ (max |Δ| ")
    assert list(tmp_path.iterdir()) == []


def test_a_fold_that_fails_runs_the_aot_lowering_and_says_why(tiny_results, tmp_path, monkeypatch):
    _, _, inputs = _inputs(tiny_results, "int8keepproj")

    def broken(aimodel, out_dir):
        raise ValueError("a coreai.blockwise_shift_scale operand is coreai.add, not a constant")
    monkeypatch.setattr(gate_lowering, "fold_constants", broken)
    with gate_lowering.gate_lowering(inputs, tmp_path / "g.json") as (lowering, ran):
        assert lowering == inputs["aimodelx"]
    assert ran["fold_refused"] == ("the fold failed (ValueError: a coreai.blockwise_shift_scale operand is "
                                   "coreai.add, not a constant)")


def test_an_fp16_bundle_with_a_small_head_has_nothing_to_fold_and_runs_the_aot_lowering(tiny_results, tmp_path):
    _, _, inputs = _inputs(tiny_results, "fp16")  # 256 x 128 and smaller: every conv2d under MATMUL_MIN
    with gate_lowering.gate_lowering(inputs, tmp_path / "g.json") as (lowering, ran):
        assert lowering == inputs["aimodelx"] and ran == {"ran": gate_lowering.PIPELINE}
    assert list(tmp_path.iterdir()) == []


WORLD_HEAD = 65536 * 128  # rwkv7-tiny's head: the one weight of at least MATMUL_MIN values


@pytest.mark.parametrize("recipe, moved", [("fp32", {"moved_matmuls": 2, "moved_convs": 0}),
                                           ("fp16", {"moved_matmuls": 0, "moved_convs": 2})])
def test_a_world_vocabulary_gate_runs_the_head_on_the_weight_stored_transposed(tiny_results, tmp_path, recipe, moved):
    from recurrent_coreai.coreai.constant_fold import fold_constants

    lay, _, inputs = _inputs(tiny_results, recipe, model="rwkv7-tiny")
    folded = tmp_path / inputs["aimodelx"].name
    folded.mkdir()
    info = fold_constants(inputs["aimodel"], folded)
    assert WORLD_HEAD >= MATMUL_MIN
    # the head of main and of prefill, one weight moved once; nothing else is that large
    assert info == {"folded_ops": 0, "distinct_weights": 0, "folded_weights": 0, **moved, "moved_weights": WORLD_HEAD}
    # the runtime's own kernel on the shipped program is the other side: a prefill chunk, then 40
    # decode steps, every logits vector and both states after each call, bit for bit
    tokens = [int(t) for t in inputs["stream"]["prefill_tokens"]]
    with PromptSession(inputs["aimodelx"], inputs["record"]) as a, PromptSession(folded, inputs["record"]) as b:
        assert a.prefill_chunk(tokens[:a.chunk]).tobytes() == b.prefill_chunk(tokens[:b.chunk]).tobytes()
        for t in [*tokens[a.chunk:], *range(40 - len(tokens[a.chunk:]))]:
            assert a.step(t).tobytes() == b.step(t).tobytes()
            sa, sb = a.state_arrays(), b.state_arrays()
            assert all(sa[n].tobytes() == sb[n].tobytes() for n in sa)
    built = json.loads(lay.gate_json(recipe).read_text())
    assert [{k: r.get(k) for k in ("ran", *moved, "bit_identical")} for r in built["lowering_runs"]] == \
        [{"ran": gate_lowering.FOLDED, **moved, "bit_identical": True}]
    assert f"{describe(info)}, bit-identical to the aot stage's lowering on 3 calls" in lay.card.read_text()


def test_the_world_vocabulary_int8_gate_runs_its_dequantised_head_as_an_fp32_matmul(tiny_results):
    """The int8keepproj head is dequantised by the fold, then reshaped for its 1 x 1 convolution:
    moved too, as the build's gate record and card say (the prefill check and every decode step
    of that gate bit-identical to the aot lowering is the previous test's; here the record)."""
    lay = Layout(tiny_results, "rwkv7-tiny")
    built = json.loads(lay.gate_json("int8keepproj").read_text())
    (run,) = built["lowering_runs"]
    assert run["ran"] == gate_lowering.FOLDED and run["bit_identical"] is True
    assert run["folded_ops"] > 0 and run["moved_convs"] == 2 and run["moved_weights"] == WORLD_HEAD
    assert describe(run) in lay.card.read_text()


def test_describe_names_each_part_of_the_fold():
    assert describe({"folded_ops": 10, "moved_matmuls": 0, "moved_convs": 1}) == (
        "its int8 dequantisation evaluated once instead of on every call and its 1 fp16 1 x 1 convolution by a "
        "large constant weight run as fp32 matmuls on that weight widened and stored transposed, rounded once to "
        "fp16 (the runtime sums such a convolution in fp32)")
    assert describe({"moved_matmuls": 2}) == ("its 2 matmuls by a large constant weight run on that weight stored "
                                              "transposed (the same products)")
    assert describe({"folded_ops": 0, "moved_matmuls": 0, "moved_convs": 0}) == ""


def test_matmuls_whose_weights_exceed_the_cap_are_left_as_they_are(tiny_results, tmp_path, monkeypatch):
    from recurrent_coreai.coreai import constant_fold

    lay = Layout(tiny_results, "rwkv7-tiny")
    bundle = next(lay.export("fp32").glob("*.aimodel"))
    monkeypatch.setattr(constant_fold, "MATMUL_MAX_BYTES", 65536 * 128 * 4 - 1)  # one byte under the head
    with pytest.raises(constant_fold.NothingToFold, match="nothing to fold"):
        constant_fold.fold_constants(bundle, tmp_path)


def test_convolutions_whose_fp32_copies_exceed_the_cap_are_left_as_they_are(tiny_results, tmp_path, monkeypatch):
    from recurrent_coreai.coreai import constant_fold

    bundle = next(Layout(tiny_results, "rwkv7-tiny").export("fp16").glob("*.aimodel"))
    monkeypatch.setattr(constant_fold, "CONV_MAX_BYTES", WORLD_HEAD * 4 - 1)  # one byte under the head's fp32 copy
    with pytest.raises(constant_fold.NothingToFold, match="nothing to fold"):
        constant_fold.fold_constants(bundle, tmp_path)


def test_a_quantised_gate_shard_asks_for_the_folds_measured_peak():
    """At 1.5B int8keepproj a gate shard peaked at 8847 MB (folding, then both lowerings loaded for
    the check; docs/measurements/2026-12-02-gate-shards.md): a SLURM job must ask at least that."""
    from recurrent_coreai.pipeline import resources

    params = 1_527_000_000  # rwkv7-1.5b-shape
    assert resources.estimate("gate_shard", params, dtype="quantized")["mem_mb"] >= 8847
    assert resources.estimate("gate_shard", params, dtype="float16")["mem_mb"] < 8847  # fp16 folds nothing


def test_a_chunk_wide_fp16_linear_of_another_shape_folds_to_the_same_bits(tmp_path):
    """The convolution rewrite beyond the default heads (every one of them 1 column, 128 wide): an
    fp16 linear as the pipeline writes it (layers.linear) of 12000 x 96 (just over MATMUL_MIN) over
    an 8-token chunk (an input [1, 96, 1, 8]: the reshape and transposes with N = 8), exported,
    lowered as the aot stage lowers it and folded; the folded lowering's outputs are the shipped
    lowering's bit for bit, on inputs of several scales."""
    import coreai.runtime as rt
    import coreai_torch
    import torch

    from recurrent_coreai.coreai.constant_fold import fold_constants
    from recurrent_coreai.coreai.layers import linear
    from recurrent_coreai.coreai.runtime import RuntimeLoop, lower_universal

    rows, width, tokens = 12000, 96, 8
    assert rows * width >= MATMUL_MIN

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.proj = torch.nn.Linear(width, rows, bias=False).half()

        def forward(self, x):
            return linear(self.proj, x)

    ep = torch.export.export(Head().eval(), (torch.zeros(tokens, width, dtype=torch.float16),))
    converter = coreai_torch.TorchConverter(mode=coreai_torch.TorchConverter.Mode.RELEASE)
    converter.add_exported_program(ep.run_decompositions(coreai_torch.get_decomp_table()), input_names=["x"],
                                   output_names=["out"], state_names=[], entrypoint_name="main")
    aimodel, shipped, folded = tmp_path / "h.aimodel", tmp_path / "shipped.aimodelx", tmp_path / "folded.aimodelx"
    converter.to_coreai().save_asset(aimodel)
    shipped.mkdir()
    folded.mkdir()
    lower_universal(aimodel, shipped)
    info = fold_constants(aimodel, folded)
    assert info["moved_convs"] == 1 and info["moved_weights"] == rows * width and info["moved_matmuls"] == 0
    xs = [(np.random.default_rng(i).standard_normal((tokens, width)) * scale).astype(np.float16)
          for i, scale in enumerate((0.1, 1.0, 4.0, 30.0))]

    async def outputs(lowering: Path) -> list[np.ndarray]:
        fn = (await rt.AIModel.load(str(lowering))).load_function("main")
        return [(await fn(inputs={"x": rt.NDArray(x)}, state={}))["out"].numpy().copy() for x in xs]
    loop = RuntimeLoop()
    try:
        want, got = loop.run(outputs(shipped)), loop.run(outputs(folded))
    finally:
        loop.close()
    assert [a.shape for a in want] == [(tokens, rows)] * len(xs)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(want, got))
