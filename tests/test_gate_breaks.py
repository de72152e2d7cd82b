"""The gate must be able to fail: break the export on purpose and assert the gate rejects it.

Each case exports the tiny model (fp32, fast in the Linux runtime; prefill chunk 16), lowers it
to `universal` and runs the real gate on short teacher-forced streams (28 decode steps, a
37-token prefill stream: 2 chunks and a 5-token tail). A control case must pass. Cases that do not
change the export (a corrupted bundle, a stale lowering) work on copies of the control's build.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import numpy as np
import pytest
import torch
import yaml

from recurrent_coreai import families
from recurrent_coreai.families.rwkv7 import chunked
from recurrent_coreai.stages import cli
from recurrent_coreai.stages import export
from recurrent_coreai.families.rwkv7 import export_graph
from recurrent_coreai.stages.aot import build_target
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.stages.export import export_recipe
from recurrent_coreai.stages.gate import gate_bundle
from recurrent_coreai.stages.reference import reference_stream
from recurrent_coreai.tokenizers.world import WorldTokenizer
from test_chunked import WKV_MUTATIONS, mutant_wkv_chunk

PROMPTS = ["Hello, who are you?", "What is 17 times 23?"]
STEPS = 28
CHUNK = 16
BUNDLE = "rwkv7-tiny-fp32"


@pytest.fixture(scope="module", autouse=True)
def _no_decode_only_conversion():
    """These bundles only feed the gate: skip the second conversion behind size_bytes_decode_only."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export, "DECODE_ONLY_MAX_PARAMS", 0)
        yield


@pytest.fixture(scope="module")
def stream_path(tmp_path_factory, tiny_source, world_vocab):
    path = tmp_path_factory.mktemp("ref") / "stream.npz"
    with open(path, "wb") as fh:
        np.savez(fh, **reference_stream(families.get("rwkv7"), tiny_source, WorldTokenizer(world_vocab), PROMPTS,
                                        STEPS, prefill={"chunk": CHUNK}))
    return path


def settings(cfg):
    return {"prompts": PROMPTS, "steps": STEPS, "near_tie_epsilon": cfg["gate"]["near_tie_epsilon"],
            "thresholds": cfg["gate"]["thresholds"]["fp32"]}


def build(top, cfg, tiny_source, corrupt=None):
    """Export (chunk 16) and lower into ``top``; ``corrupt`` edits the bundle before lowering."""
    export_dir, aot_dir = top / "export", top / "aot"
    export_recipe(families.get("rwkv7"), tiny_source, "fp32", cfg["recipes"]["fp32"], BUNDLE, export_dir, CHUNK)
    if corrupt:
        corrupt(export_dir / f"{BUNDLE}.aimodel")
    build_target(export_dir, BUNDLE, "fp32", "universal", cfg["targets"]["universal"], cfg["aot"], aot_dir)
    return export_dir, aot_dir


def gate(top, cfg, stream_path):
    return gate_bundle("rwkv7-tiny", "fp32", top / "export", top / "aot", stream_path, settings(cfg),
                       top / "gate.json", top / "gate.tsv")


@pytest.fixture(scope="module")
def control(tmp_path_factory, cfg, tiny_source):
    """The unbroken build, made once; tests that alter it work on a copy."""
    top = tmp_path_factory.mktemp("control")
    build(top, cfg, tiny_source)
    return top


def copy_build(control, tmp_path, with_aot=True):
    shutil.copytree(control / "export", tmp_path / "export")
    if with_aot:
        shutil.copytree(control / "aot", tmp_path / "aot")
    return tmp_path


def test_control_passes(control, tmp_path, cfg, stream_path):
    result = gate(copy_build(control, tmp_path), cfg, stream_path)
    assert result["pass"] and result["steps"] == STEPS
    assert result["agree_counted"] == result["counted"] and result["max_abs_dlogits"] < 1e-3
    assert result["state_writes"] == {"main": {"recState": 1, "shiftState": 1},
                                      "prefill": {"recState": 1, "shiftState": 1}}
    pre = result["prefill"]
    assert (pre["pass"], pre["chunk"], pre["chunks"], pre["tail"], pre["tokens"]) == (True, CHUNK, 2, 5, 2 * CHUNK + 5)
    assert [r["function"] for r in pre["rows"]] == ["prefill"] * 2 + ["main"] * 5
    assert pre["agree_counted"] == pre["counted"] == 7 and pre["max_abs_dstate"] < 1e-4
    rows = (tmp_path / "gate.tsv").read_text().splitlines()
    assert len(rows) == STEPS + 1 and rows[0].startswith("step\tprompt")


def _rejects(top, cfg, tiny_source, stream_path, corrupt=None) -> str:
    with pytest.raises(PipelineError) as exc:
        if not (top / "export").exists():
            build(top, cfg, tiny_source, corrupt)
        gate(top, cfg, stream_path)
    assert not (top / "gate.json").exists(), "a failing gate must not leave its declared output"
    failed = top / "gate.failed.json"
    if failed.exists():
        assert json.loads(failed.read_text())["pass"] is False
    return str(exc.value)


def test_wrong_decay_sign_is_rejected(tmp_path, cfg, tiny_source, stream_path, monkeypatch):
    monkeypatch.setattr(export_graph, "NEG_EXP_HALF", math.exp(-0.5))  # decay > 1
    msg = _rejects(tmp_path, cfg, tiny_source, stream_path)
    assert "gate FAILED" in msg and ("top-1" in msg or "dlogits" in msg)


def _per_layer_forward(self, input_ids, position_ids):
    x = self.model.embeddings(input_ids.reshape(1).to(torch.int64))
    v_first = x
    for i, block in enumerate(self.model.layers):
        x, att, ffn, S, v_first = block.step(x, self.shiftState[i, :, 0], self.shiftState[i, :, 1],
                                             self.recState[i], v_first)
        self.recState[i].copy_(S)                                   # one write per layer: broken
        self.shiftState[i].copy_(torch.stack([att, ffn], dim=1))
    return self.lm_head(self.model.norm(x)).reshape(1, 1, self.g.vocab)


def test_swapped_token_shift_slots_are_rejected(tmp_path, cfg, tiny_source, stream_path, monkeypatch):
    original = export_graph.Block.step

    def swapped(self, x, att_prev, ffn_prev, S, v_first):
        x, att, ffn, S_new, v_first = original(self, x, att_prev, ffn_prev, S, v_first)
        return x, ffn, att, S_new, v_first                         # slot 0 <-> slot 1

    monkeypatch.setattr(export_graph.Block, "step", swapped)
    msg = _rejects(tmp_path, cfg, tiny_source, stream_path)
    assert "gate FAILED" in msg


def _corrupt_weights(aimodel):
    blob = aimodel / "main.mlirb"
    data = bytearray(blob.read_bytes())
    rng = np.random.default_rng(0)
    for frac in (0.2, 0.4, 0.6, 0.8):            # the file is ~all weights: embeddings and lm_head
        start = int(len(data) * frac)
        data[start:start + 64 * 1024] = rng.integers(0, 256, 64 * 1024, dtype=np.uint8).tobytes()
    blob.write_bytes(bytes(data))


def test_corrupted_weight_in_bundle_is_rejected(control, tmp_path, cfg, stream_path):
    top = copy_build(control, tmp_path, with_aot=False)
    _corrupt_weights(top / "export" / f"{BUNDLE}.aimodel")
    build_target(top / "export", BUNDLE, "fp32", "universal", cfg["targets"]["universal"], cfg["aot"], top / "aot")
    msg = _rejects(top, cfg, None, stream_path)
    assert "gate FAILED" in msg and "top-1 agreement" in msg  # the runtime does not check main.hash
    assert "prefill: top-1 agreement" in msg                  # the prefill path runs the same weights


# --- prefill: the chunk math and the contract ------------------------------------------------------
@pytest.mark.parametrize("mutation,needle", [
    ("decay offset: inclusive cumsum where exclusive is due", r"prefill: state \w+ after \d+ tokens differs"),
    ("missing in-chunk delta term in o", r"prefill: (top-1 agreement|max\|dlogits\||state \w+ after)")],
    ids=["decay-offset", "missing-in-chunk-term"])
def test_broken_prefill_chunk_is_rejected(tmp_path, cfg, tiny_source, stream_path, monkeypatch, mutation, needle):
    """The decode path is untouched (T = 1 never reaches the chunk): only the prefill check can
    see these, and it must fail the gate."""
    monkeypatch.setattr(chunked, "wkv_chunk", mutant_wkv_chunk(*WKV_MUTATIONS[mutation]))
    msg = _rejects(tmp_path, cfg, tiny_source, stream_path)
    failed = json.loads((tmp_path / "gate.failed.json").read_text())
    assert failed["agree_counted"] == failed["counted"] == STEPS and failed["max_abs_dlogits"] < 1e-3, \
        "the decode path must still pass: the break is in the chunk only"
    assert "gate FAILED" in msg and re.search(needle, msg), msg
    assert failed["prefill"]["pass"] is False


def _prefill_writing_rec_twice(self, input_ids, position_ids):
    """Numerically right, but recState gets a second write right after the first:
    ``x.copy_(a); x.copy_(b)`` — the second copy traces onto the first one's output."""
    x = export_graph.run_layers(self, self.model.embeddings(input_ids.reshape(self.chunk).to(torch.int64)))
    self.recState.copy_(self.recState * 1.0)
    return self.lm_head(self.model.norm(x[-1:])).reshape(1, 1, self.g.vocab)


def test_states_written_more_than_once_are_rejected_in_every_function(tmp_path, cfg, tiny_source, stream_path,
                                                                     monkeypatch):
    """The contract, for both functions in one bundle (one export for the two breaks): decode
    writes the states per layer, prefill writes recState twice in a row. Both compute the right
    numbers, so only the contract can catch them."""
    monkeypatch.setattr(export_graph.RWKV7Decode, "forward", _per_layer_forward)
    monkeypatch.setattr(export_graph.RWKV7Prefill, "forward", _prefill_writing_rec_twice)
    msg = _rejects(tmp_path, cfg, tiny_source, stream_path)
    assert "state recState is written 2 times per call of main" in msg
    assert "state shiftState is written 2 times per call of main" in msg
    assert "state recState is written 2 times per call of prefill" in msg
    assert "state shiftState is written 2 times per call of prefill" not in msg
    failed = json.loads((tmp_path / "gate.failed.json").read_text())
    assert failed["prefill"]["pass"] is True and failed["agree_counted"] == failed["counted"]  # the numbers agree


# --- the CLI and stale inputs ---------------------------------------------------------------------
def test_gate_cli_exits_nonzero_and_writes_no_output(control, tmp_path, cfg, stream_path, capsys):
    top = copy_build(control, tmp_path, with_aot=False)
    _corrupt_weights(top / "export" / f"{BUNDLE}.aimodel")
    build_target(top / "export", BUNDLE, "fp32", "universal", cfg["targets"]["universal"], cfg["aot"], top / "aot")
    conf = tmp_path / "config.yaml"
    raw = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "config.yaml")))
    raw["gate"].update(prompts=PROMPTS, steps=STEPS)  # the stream's own
    raw["gate"].pop("text")  # this short stream holds no text stream (tests/test_gate_text.py gates one)
    conf.write_text(yaml.safe_dump(raw, allow_unicode=True))
    rc = cli.gate(["--config-file", str(conf), "--model", "rwkv7-tiny", "--recipe", "fp32",
                   "--export", str(top / "export"), "--aot", str(top / "aot"), "--reference", str(stream_path),
                   "--json", str(tmp_path / "g.json"), "--tsv", str(tmp_path / "g.tsv")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert len(err) == 1 and err[0].startswith("error: ") and "gate FAILED for rwkv7-tiny/fp32" in err[0]
    assert not (tmp_path / "g.json").exists() and (tmp_path / "g.failed.json").exists()


def test_a_lowering_of_other_bytes_is_not_gated(control, tmp_path, cfg, stream_path):
    """The gate runs the lowering only if aot.json says it was built from exactly this bundle."""
    top = copy_build(control, tmp_path)
    metadata = top / "export" / f"{BUNDLE}.aimodel" / "metadata.json"
    metadata.write_text(metadata.read_text() + " ")  # the bundle changed after it was lowered
    with pytest.raises(PipelineError, match="was lowered from other bytes than"):
        gate(top, cfg, stream_path)
    assert not (top / "gate.json").exists()


def test_a_reference_for_another_chunk_is_refused(control, tmp_path, cfg, tiny_source, world_vocab):
    """A reference made for prefill chunk 8 cannot check a bundle whose prefill takes 16 tokens."""
    other = tmp_path / "stream8.npz"
    with open(other, "wb") as fh:
        np.savez(fh, **reference_stream(families.get("rwkv7"), tiny_source, WorldTokenizer(world_vocab), PROMPTS,
                                        STEPS, prefill={"chunk": 8}))
    with pytest.raises(PipelineError, match="was made for prefill chunk 8, but the bundle's prefill takes 16 tokens"):
        gate(copy_build(control, tmp_path), cfg, other)
    assert not (tmp_path / "gate.json").exists()


def test_a_gate_that_counted_too_few_steps_fails(control, tmp_path, cfg, stream_path):
    """The bundle agrees at every step, but at near_tie_epsilon 1 (allowed: below 0.02 of this
    reference's logit scale) some steps are near-ties, and min_counted 1 asks for every step:
    the gate fails, says so, and writes only its .failed.json (tests/test_gate_counted.py: the rules)."""
    margins = np.diff(np.sort(np.load(stream_path)["logits"], axis=1)[:, -2:], axis=1)[:, 0]
    ties = int((margins < 1.0).sum())
    assert 0 < ties < STEPS, "the reference must hold near-ties at epsilon 1 for this case"
    top = copy_build(control, tmp_path)
    s = {**settings(cfg), "near_tie_epsilon": 1.0, "thresholds": {**cfg["gate"]["thresholds"]["fp32"], "min_counted": 1.0}}
    with pytest.raises(PipelineError) as exc:
        gate_bundle("rwkv7-tiny", "fp32", top / "export", top / "aot", stream_path, s, top / "gate.json", top / "gate.tsv")
    failed = json.loads((top / "gate.failed.json").read_text())
    # counted over the decode rows and the prefill check's together (stages/gate_verdict.py)
    pre = failed["prefill"]
    assert f"gate FAILED for rwkv7-tiny/fp32: only {STEPS - ties + pre['counted']}/{STEPS + pre['steps']} steps " \
           "counted outside near-ties, fewer than min_counted 1 of them" in str(exc.value), str(exc.value)
    assert not (top / "gate.json").exists() and failed["pass"] is False
    assert failed["agree_counted"] == failed["counted"] == STEPS - ties and failed["thresholds"]["min_counted"] == 1.0
    assert failed["reference_logit_scale"] > 1.0 / 0.02
