"""The synthetic source: exact HF layout, determinism, and logits worth comparing."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from recurrent_coreai.families.rwkv7.geometry import Geometry, expected_shapes
from recurrent_coreai.families.rwkv7.reference import Reference
from recurrent_coreai.stages.source import build_source

TINY = Geometry(layers=2, hidden=128, head_dim=64, ffn=512, vocab=65536, decay_lora=16, a_lora=16, v_lora=16,
                gate_lora=32)
GOOSE_1_5B = Geometry(layers=24, hidden=2048, head_dim=64, ffn=8192, vocab=65536, decay_lora=96, a_lora=96,
                      v_lora=64, gate_lora=256)


def test_names_and_shapes_are_the_hf_layout(tiny_source):
    with safe_open(tiny_source / "model.safetensors", "pt") as fh:
        got = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    assert got == expected_shapes(TINY)
    # the layout of the 1.5B checkpoint, checked on a few names from its file
    shapes = expected_shapes(GOOSE_1_5B)
    assert shapes["model.layers.0.attn.x_r"] == (1, 1, 2048)
    assert shapes["model.layers.3.attn.w_lora.lora.0.weight"] == (96, 2048)
    assert shapes["model.layers.3.attn.v_lora.lora.2.bias"] == (2048,)
    assert "model.layers.0.attn.v_lora.lora.0.weight" not in shapes
    assert "model.layers.1.pre_norm.weight" not in shapes and "model.layers.0.pre_norm.bias" in shapes
    assert shapes["model.layers.5.attn.r_k"] == (32, 64) and shapes["lm_head.weight"] == (65536, 2048)
    assert sum(torch.Size(s).numel() for s in shapes.values()) > 1.5e9


def test_config_json_round_trips(tiny_source):
    cfg = json.loads((tiny_source / "config.json").read_text())
    assert cfg["model_type"] == "rwkv7" and cfg["architectures"] == ["RWKV7ForCausalLM"]
    assert Geometry.from_hf_config(cfg) == TINY


def test_same_seed_is_byte_identical(tmp_path, cfg, tiny_source):
    again = tmp_path / "again"
    build_source("rwkv7-tiny", cfg["models"]["rwkv7-tiny"], cfg["vocab"], again)
    for name in ("model.safetensors", "config.json", "manifest.json", "rwkv_vocab_v20230424.txt"):
        assert (again / name).read_bytes() == (tiny_source / name).read_bytes(), name


def test_other_seed_differs(tmp_path, cfg, tiny_source):
    model = json.loads(json.dumps(cfg["models"]["rwkv7-tiny"]))
    model["source"]["seed"] += 1
    build_source("rwkv7-tiny", model, cfg["vocab"], tmp_path / "other")
    assert (tmp_path / "other" / "model.safetensors").read_bytes() != (tiny_source / "model.safetensors").read_bytes()


def test_manifest_hashes_every_file(tiny_source):
    import hashlib

    manifest = json.loads((tiny_source / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "synthetic" and manifest["layout"] == "fla-split"
    for rel, entry in manifest["files"].items():
        data = (tiny_source / rel).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def test_logits_are_peaked_not_degenerate(tiny_source):
    from recurrent_coreai.checkpoints.reader import load_checkpoint

    geom, sd = load_checkpoint(tiny_source)
    ref = Reference(sd, geom)
    logits, _ = ref.run([0, 24281, 59, 4571, 261, 5585, 41693, 59] + list(range(1000, 1040)))
    top2 = logits.topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    assert torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 1.0                   # not flat
    assert margins.median() > 1.0 and (margins < 0.1).float().mean() < 0.1
    assert len(set(logits.argmax(-1).tolist())) > 20        # not one token everywhere


def test_chunked_normal_draws_what_one_call_draws(monkeypatch):
    """synthetic.chunked_normal draws RANDN_CHUNK values per call; values and the generator state after
    must be those of the one-call form it replaced, for every size around the chunk boundaries."""
    from recurrent_coreai.families.rwkv7 import synthetic

    monkeypatch.setattr(synthetic, "RANDN_CHUNK", 32)
    for n in [*range(0, 100), 127, 128, 129, 1000, 4096 + 7]:
        shape = (n,) if n % 3 else (1, n)
        one, chunked = torch.Generator().manual_seed(n), torch.Generator().manual_seed(n)
        want = torch.randn(shape, generator=one, dtype=torch.float64).mul(0.7).float()
        assert torch.equal(synthetic.chunked_normal(shape, 0.7, chunked), want), n
        assert torch.equal(torch.rand(4, generator=one), torch.rand(4, generator=chunked)), n
