"""The gate must be able to fail: break the export on purpose and assert the gate rejects it.

Each case exports the tiny model (fp32, fast in the Linux runtime), lowers it to `universal`
and runs the real gate on a short teacher-forced stream. A control case must pass.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from rwkv7_coreai import cli, export_graph
from rwkv7_coreai.aot import build_target
from rwkv7_coreai.errors import PipelineError
from rwkv7_coreai.export import export_recipe
from rwkv7_coreai.gate import gate_bundle
from rwkv7_coreai.reference_stream import reference_stream

PROMPTS = ["Hello, who are you?", "What is 17 times 23?"]
STEPS = 28
BUNDLE = "rwkv7-tiny-fp32"


@pytest.fixture(scope="module")
def stream_path(tmp_path_factory, tiny_source, world_vocab):
    path = tmp_path_factory.mktemp("ref") / "stream.npz"
    with open(path, "wb") as fh:
        np.savez(fh, **reference_stream(tiny_source, world_vocab, PROMPTS, STEPS))
    return path


def settings(cfg):
    return {"prompts": PROMPTS, "steps": STEPS, "near_tie_epsilon": cfg["gate"]["near_tie_epsilon"],
            "thresholds": cfg["gate"]["thresholds"]["fp32"]}


def build_and_gate(tmp_path, cfg, tiny_source, stream_path, corrupt=None):
    export_dir, aot_dir = tmp_path / "export", tmp_path / "aot"
    export_recipe(tiny_source, "fp32", cfg["recipes"]["fp32"], BUNDLE, export_dir)
    if corrupt:
        corrupt(export_dir / f"{BUNDLE}.aimodel")
    build_target(export_dir, BUNDLE, "fp32", "universal", cfg["targets"]["universal"], cfg["aot"], aot_dir)
    return gate_bundle("rwkv7-tiny", "fp32", export_dir, aot_dir, stream_path, settings(cfg),
                       tmp_path / "gate.json", tmp_path / "gate.tsv")


def test_control_passes(tmp_path, cfg, tiny_source, stream_path):
    result = build_and_gate(tmp_path, cfg, tiny_source, stream_path)
    assert result["pass"] and result["steps"] == STEPS
    assert result["agree_counted"] == result["counted"] and result["max_abs_dlogits"] < 1e-3
    assert result["state_writes_per_step"] == {"recState": 1, "shiftState": 1}
    rows = (tmp_path / "gate.tsv").read_text().splitlines()
    assert len(rows) == STEPS + 1 and rows[0].startswith("step\tprompt")


def _rejects(tmp_path, cfg, tiny_source, stream_path, corrupt=None) -> str:
    with pytest.raises(PipelineError) as exc:
        build_and_gate(tmp_path, cfg, tiny_source, stream_path, corrupt)
    assert not (tmp_path / "gate.json").exists(), "a failing gate must not leave its declared output"
    failed = tmp_path / "gate.failed.json"
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


def test_states_written_per_layer_are_rejected(tmp_path, cfg, tiny_source, stream_path, monkeypatch):
    monkeypatch.setattr(export_graph.RWKV7Decode, "forward", _per_layer_forward)
    msg = _rejects(tmp_path, cfg, tiny_source, stream_path)
    assert "state recState is written 2 times per step" in msg


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


def test_corrupted_weight_in_bundle_is_rejected(tmp_path, cfg, tiny_source, stream_path):
    msg = _rejects(tmp_path, cfg, tiny_source, stream_path, corrupt=_corrupt_weights)
    assert "gate FAILED" in msg and "top-1 agreement" in msg  # the runtime does not check main.hash


def test_gate_cli_exits_nonzero_and_writes_no_output(tmp_path, cfg, tiny_source, stream_path, monkeypatch, capsys):
    monkeypatch.setattr(export_graph, "NEG_EXP_HALF", math.exp(-0.5))
    export_dir, aot_dir = tmp_path / "export", tmp_path / "aot"
    export_recipe(tiny_source, "fp32", cfg["recipes"]["fp32"], BUNDLE, export_dir)
    build_target(export_dir, BUNDLE, "fp32", "universal", cfg["targets"]["universal"], cfg["aot"], aot_dir)
    conf = tmp_path / "config.yaml"
    conf.write_text((cfg_path := os.path.join(os.path.dirname(__file__), "..", "config.yaml")) and
                    open(cfg_path).read().replace("steps: 127", f"steps: {STEPS}"))
    rc = cli.gate(["--config-file", str(conf), "--model", "rwkv7-tiny", "--recipe", "fp32",
                   "--export", str(export_dir), "--aot", str(aot_dir), "--reference", str(stream_path),
                   "--json", str(tmp_path / "g.json"), "--tsv", str(tmp_path / "g.tsv")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert len(err) == 1 and err[0].startswith("error: ") and "gate FAILED for rwkv7-tiny/fp32" in err[0]
    assert not (tmp_path / "g.json").exists() and (tmp_path / "g.failed.json").exists()


def test_a_lowering_of_other_bytes_is_not_gated(tmp_path, cfg, tiny_source, stream_path):
    """The gate runs the lowering only if aot.json says it was built from exactly this bundle."""
    export_dir, aot_dir = tmp_path / "export", tmp_path / "aot"
    export_recipe(tiny_source, "fp32", cfg["recipes"]["fp32"], BUNDLE, export_dir)
    build_target(export_dir, BUNDLE, "fp32", "universal", cfg["targets"]["universal"], cfg["aot"], aot_dir)
    metadata = export_dir / f"{BUNDLE}.aimodel" / "metadata.json"
    metadata.write_text(metadata.read_text() + " ")  # the bundle changed after it was lowered
    with pytest.raises(PipelineError, match="was lowered from other bytes than"):
        gate_bundle("rwkv7-tiny", "fp32", export_dir, aot_dir, stream_path, settings(cfg),
                    tmp_path / "gate.json", tmp_path / "gate.tsv")
    assert not (tmp_path / "gate.json").exists()
