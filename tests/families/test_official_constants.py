"""Constants the official implementations fix, checked AT GEOMETRIES WHERE A RULE DERIVED FROM THE
SHAPE WOULD GIVE ANOTHER VALUE (head sizes 8, 16, 32 rather than 64), against those implementations.

The audit and its table: docs/measurements/2026-12-05-constants-audit.md. Each comparison here
failed with the project's earlier rule (checked by reverting it; the numbers are in that table);
the in-test ``old rule`` copies show the same from inside the test.

* RWKV-6 (x060) ``ln_x`` GroupNorm eps: 1e-5 * head_size_divisor**2 (64e-5, whatever the head size),
  not head_size * 1e-5 -- against rwkv==0.8.32's x060 (its own process, tests/families/rwkv6_official.py);
  the source stage's written config.json (head_size_divisor 8) is read back by the same reader.
* RWKV-7 (x070) ``ln_x``/``g_norm`` GroupNorm eps: 64e-5 (BlinkDL), not head_dim * norm_eps (fla's
  rule, kept only for an fla config.json that states no other) -- against rwkv==0.8.32's x070.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recurrent_coreai.families import get

pytestmark = pytest.mark.usefixtures("one_thread")
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TOL = 1e-4          # fp32 vs fp32, as the other official comparisons
HEADS = (8, 16, 32)
N_TOKENS = 40


# === RWKV-6 (x060): ln_x eps =======================================================================
R6 = get("rwkv6")


def _r6():
    from recurrent_coreai.families.rwkv6 import geometry

    return geometry


def r6_geometry(head_dim: int, **over):
    return _r6().Geometry(layers=2, hidden=64, head_dim=head_dim, ffn=224, vocab=300, mix_lora=8, decay_lora=16,
                          **over)


def run_rwkv6_official(pth: Path, tokens: list[int], tmp: Path) -> dict[str, np.ndarray]:
    (tmp / "tokens.json").write_text(json.dumps(tokens))
    env = {k: v for k, v in os.environ.items() if k != "RWKV_V7_ON"}
    env.update(RWKV_JIT_ON="0", RWKV_CUDA_ON="0", OMP_NUM_THREADS="1")
    out = tmp / "official.npz"
    res = subprocess.run([sys.executable, str(HERE / "rwkv6_official.py"), str(pth), str(tmp / "tokens.json"),
                          str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return dict(np.load(out))


def r6_deltas(ref, tokens, official) -> dict[str, float]:
    logits, state = ref.run(tokens)
    b = ref.bundle_states(state)
    return {"logits": float(np.abs(logits.float().numpy() - official["logits"]).max()),
            "wkv": float(np.abs(b["recState"][:, 0] - official["wkv"]).max())}


@pytest.fixture(scope="module")
def r6_case(tmp_path_factory):
    cache: dict[int, tuple] = {}

    def build(head_dim: int):
        if head_dim not in cache:
            g = r6_geometry(head_dim)
            sd = dict(R6.synthetic_tensors(g, seed=11))
            tmp = tmp_path_factory.mktemp(f"rwkv6-h{head_dim}")
            pth = R6.write_layout(sd, tmp, "blinkdl")
            tokens = torch.randint(0, g.vocab, (N_TOKENS,), generator=torch.Generator().manual_seed(5)).tolist()
            cache[head_dim] = (g, sd, tokens, run_rwkv6_official(pth, tokens, tmp))
        return cache[head_dim]

    return build


def test_rwkv6_ln_x_eps_rule():
    """One function, 1e-5 * divisor**2: 64e-5 at every head size with the official divisor 8, never
    scaled by layer_norm_epsilon; at head size 64 the very float the earlier rule gave (1e-5 * 64), so
    the rwkv6-tiny bundles (head 64) are unchanged byte for byte."""
    geo = _r6()
    assert geo.ln_x_eps() == 64e-5 == geo.ln_x_eps(8)
    assert geo.ln_x_eps(4) == 1e-5 * 16
    for h in (*HEADS, 64, 128):
        assert r6_geometry(h).ln_x_eps == 64e-5, h
        assert r6_geometry(h, norm_eps=1e-6).ln_x_eps == 64e-5, h  # layer_norm_epsilon: the LayerNorms only
    assert r6_geometry(64).ln_x_eps == 64 * 1e-5 == 1e-5 * 64     # the earlier head_dim * norm_eps at head 64
    # the records: the official divisor leaves as_dict as it was, another one is stated
    assert "head_size_divisor" not in r6_geometry(8).as_dict()
    g4 = r6_geometry(8, head_size_divisor=4)
    assert g4.as_dict()["head_size_divisor"] == 4 and R6.geometry_from_dict(g4.as_dict()) == g4


@pytest.mark.parametrize("head_dim", HEADS)
def test_rwkv6_reference_matches_official_at_small_heads(r6_case, head_dim):
    g, sd, tokens, official = r6_case(head_dim)
    assert np.abs(official["wkv"]).max() > 0.1          # the state is exercised
    d = r6_deltas(R6.reference(sd, g), tokens, official)
    ref_cls = type(R6.reference(sd, g))
    old = type("OldRule", (ref_cls,), {"ln_x_eps": head_dim * g.norm_eps})   # head_size * 1e-5
    d_old = r6_deltas(old(sd, g), tokens, official)
    print(f"rwkv6 head {head_dim}: reference vs rwkv 0.8.32 x060 {d}; old rule (eps {head_dim}e-5) {d_old}")
    assert all(v <= TOL for v in d.values()), d
    assert not d_old["logits"] <= TOL, d_old            # the geometry really tells the two rules apart


@pytest.mark.parametrize("head_dim", HEADS)
def test_rwkv6_export_modules_match_official_at_small_heads(r6_case, head_dim):
    """The fp32 decode module (one token a call) and the prefill module (the chunked WKV) against the
    official logits: the eps reaches the exported graph, not just the reference."""
    g, sd, tokens, official = r6_case(head_dim)
    dec = R6.build_decode(sd, g, torch.float32)
    assert dec.rwkv.blocks[0].attention.ln_x.eps == 64e-5
    zero = torch.zeros(1, 1, dtype=torch.int32)
    with torch.no_grad():
        logits = np.stack([dec(torch.tensor([[t]], dtype=torch.int32), zero)[0, 0].numpy() for t in tokens])
        d_dec = float(np.abs(logits - official["logits"]).max())
        dec2 = R6.build_decode(sd, g, torch.float32)
        T = 16
        pre = R6.build_prefill(dec2, T)
        ids = torch.tensor([tokens[:T]], dtype=torch.int32)
        last = pre(ids, torch.zeros_like(ids))[0, 0].numpy()
        d_pre = float(np.abs(last - official["logits"][T - 1]).max())
    print(f"rwkv6 head {head_dim}: decode module vs official {d_dec:.3g}, prefill ({T} tokens) {d_pre:.3g}")
    assert d_dec <= TOL and d_pre <= TOL, (d_dec, d_pre)


def test_rwkv6_written_config_reads_back(tmp_path):
    """The HF-layout config.json the family writes (what the source stage puts beside the normal form)
    states the official head_size_divisor 8 at head size 8 (the earlier round(sqrt(8)) = 3 was refused
    by the reader: 3**2 != 8), and the reader takes a divisor as the file states it."""
    g = r6_geometry(8)
    sd = dict(R6.synthetic_tensors(g, seed=3))
    R6.write_layout(sd, tmp_path, "hf")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["head_size"] == 8 and cfg["head_size_divisor"] == 8
    back = R6.geometry_from_config(cfg, tmp_path / "config.json")
    assert back == g and back.ln_x_eps == 64e-5
    assert R6.config_json(back) == cfg
    # a config.json with another divisor: its own eps (the HF remote code's 1e-5 * divisor**2), kept
    g4 = R6.geometry_from_config({**cfg, "head_size_divisor": 4}, "config.json")
    assert g4.ln_x_eps == 16e-5 and R6.config_json(g4)["head_size_divisor"] == 4
    # and at head size 64 the file is what it was
    assert R6.config_json(r6_geometry(64))["head_size_divisor"] == 8


def test_rwkv6_source_stage_output_reads_back(tmp_path):
    """The source stage itself, synthetic head size 8 written as BlinkDL's .pth and normalised: its
    config.json goes back through the reader (the reference and export stages' path) to the geometry
    its manifest records."""
    import yaml

    from recurrent_coreai.checkpoints import reader
    from recurrent_coreai.stages.source import build_source

    vocab_cfg = yaml.safe_load((REPO / "config.yaml").read_text())["vocab"]
    shape = {"layers": 1, "hidden": 32, "head_dim": 8, "ffn": 64, "vocab": 65536, "mix_lora": 4, "decay_lora": 4}
    model = {"family": "rwkv6", "source": {"kind": "synthetic", "seed": 1, "layout": "blinkdl", "shape": shape}}
    manifest = build_source("rwkv6-h8", model, vocab_cfg, tmp_path / "source")
    cfg = json.loads((tmp_path / "source" / "config.json").read_text())
    assert cfg["head_size_divisor"] == 8
    g = reader.load_geometry(R6, tmp_path / "source")
    assert g == R6.geometry_from_dict(manifest["geometry"]) and g.ln_x_eps == 64e-5
