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
* Mamba-2 (no finding, pinned): every RMSNorm takes the file's layer_norm_epsilon, as transformers does.
* Gated DeltaNet (no finding in value): the q/k L2 eps is fla-core's fixed 1e-6, written once.
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
    print(f"rwkv6 head {head_dim}: reference vs rwkv 0.8.32 x060 {d}")
    assert all(v <= TOL for v in d.values()), d
    old = type("OldRule", (type(R6.reference(sd, g)),), {"ln_x_eps": head_dim * g.norm_eps})   # head_size * 1e-5
    d_old = r6_deltas(old(sd, g), tokens, official)
    print(f"rwkv6 head {head_dim}: the earlier rule (eps {head_dim}e-5) {d_old}")
    assert not d_old["logits"] <= TOL, d_old            # the geometry really tells the two rules apart


@pytest.mark.parametrize("head_dim", HEADS)
def test_rwkv6_export_modules_match_official_at_small_heads(r6_case, head_dim):
    """The fp32 decode module (one token a call) and the prefill module (the chunked WKV) against the
    official logits: the eps reaches the exported graph, not just the reference."""
    g, sd, tokens, official = r6_case(head_dim)
    dec = R6.build_decode(sd, g, torch.float32)
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
    assert dec.rwkv.blocks[0].attention.ln_x.eps == 64e-5


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


# === RWKV-7 (x070): ln_x / g_norm eps ===============================================================
R7 = get("rwkv7")



def _r7():
    from recurrent_coreai.families.rwkv7 import geometry

    return geometry


def r7_geometry(head_dim: int):
    return R7.geometry_from_shape({"layers": 2, "hidden": 64, "head_dim": head_dim, "ffn": 128, "vocab": 300,
                                   "decay_lora": 8, "a_lora": 8, "v_lora": 8, "gate_lora": 16}, "test")


def run_rwkv7_official(sd_normal: dict, tokens: list[int], tmp: Path) -> dict[str, np.ndarray]:
    from recurrent_coreai.families.rwkv7 import blinkdl

    from rwkv7_official import run_official

    torch.save(blinkdl.from_hf(sd_normal), tmp / "model.pth")
    return run_official(tmp / "model.pth", tokens, tmp)


def r7_deltas(ref, tokens, official) -> dict[str, float]:
    logits, state = ref.run(tokens)
    return {"logits": float(np.abs(logits.float().numpy() - official["logits"]).max()),
            "wkv": float(np.abs(state.wkv.float().numpy() - official["wkv"]).max())}


@pytest.fixture(scope="module")
def r7_case(tmp_path_factory):
    cache: dict[int, tuple] = {}

    def build(head_dim: int):
        if head_dim not in cache:
            g = r7_geometry(head_dim)
            sd = dict(R7.synthetic_tensors(g, seed=13))
            tokens = torch.randint(0, g.vocab, (N_TOKENS,), generator=torch.Generator().manual_seed(6)).tolist()
            cache[head_dim] = (g, sd, tokens, run_rwkv7_official(sd, tokens, tmp_path_factory.mktemp(f"rwkv7-h{head_dim}")))
        return cache[head_dim]

    return build


def test_rwkv7_g_norm_eps_rule():
    """BlinkDL's 64e-5 for a synthetic shape and a BlinkDL .pth at every head size; fla's head_dim *
    norm_eps only for an fla config.json that states no other value; at head size 64 the two are the
    same float and nothing written or recorded changes (the rwkv7-tiny bundles are head 64)."""
    geo = _r7()
    assert geo.G_NORM_EPS == 64e-5 == geo.fla_g_norm_eps(64, 1e-5)
    for h in (*HEADS, 64):
        assert r7_geometry(h).g_norm_eps == 64e-5, h
    # a BlinkDL .pth: the geometry off its tensors
    g8 = r7_geometry(8)
    sd = dict(R7.synthetic_tensors(g8, seed=1))
    from recurrent_coreai.families.rwkv7 import blinkdl

    shapes = {k: tuple(v.shape) for k, v in blinkdl.from_hf(sd).items()}
    assert R7.geometry_from_tensors(shapes, "blinkdl", "model.pth").g_norm_eps == 64e-5
    # fla's config.json: its own rule unless the file states the value
    cfg = R7.config_json(g8)
    assert cfg[geo.G_NORM_EPS_KEY] == 64e-5 and R7.geometry_from_config(cfg, "config.json") == g8
    fla_cfg = {k: v for k, v in cfg.items() if k != geo.G_NORM_EPS_KEY}
    assert R7.geometry_from_config(fla_cfg, "config.json").g_norm_eps == 8e-5
    assert R7.geometry_from_config({**fla_cfg, "norm_eps": 1e-6}, "config.json").g_norm_eps == 8 * 1e-6
    # head size 64: no extra key, no extra record field
    g64 = r7_geometry(64)
    assert geo.G_NORM_EPS_KEY not in R7.config_json(g64) and "g_norm_eps" not in g64.as_dict()
    assert R7.geometry_from_config(R7.config_json(g64), "config.json") == g64
    g32_fla = R7.geometry_from_config({**fla_cfg, "head_dim": 32, "num_heads": 2}, "config.json")
    assert g32_fla.as_dict()["g_norm_eps"] == 32e-5 and R7.geometry_from_dict(g32_fla.as_dict()) == g32_fla


@pytest.mark.parametrize("head_dim", HEADS)
def test_rwkv7_reference_matches_official_at_small_heads(r7_case, head_dim):
    import dataclasses

    g, sd, tokens, official = r7_case(head_dim)
    d = r7_deltas(R7.reference(sd, g), tokens, official)
    print(f"rwkv7 head {head_dim}: reference vs rwkv 0.8.32 x070 {d}")
    assert all(v <= TOL for v in d.values()), d
    old = dataclasses.replace(g, g_norm_eps=head_dim * g.norm_eps)        # the earlier head_dim * norm_eps
    d_old = r7_deltas(R7.reference(sd, old), tokens, official)
    print(f"rwkv7 head {head_dim}: the earlier rule (eps {head_dim}e-5) {d_old}")
    assert not d_old["logits"] <= TOL, d_old


@pytest.mark.parametrize("head_dim", HEADS)
def test_rwkv7_export_modules_match_official_at_small_heads(r7_case, head_dim):
    g, sd, tokens, official = r7_case(head_dim)
    dec = R7.build_decode(sd, g, torch.float32)
    zero = torch.zeros(1, 1, dtype=torch.int32)
    with torch.no_grad():
        logits = np.stack([dec(torch.tensor([[t]], dtype=torch.int32), zero)[0, 0].numpy() for t in tokens])
        d_dec = float(np.abs(logits - official["logits"]).max())
        T = 16
        pre = R7.build_prefill(R7.build_decode(sd, g, torch.float32), T)
        ids = torch.tensor([tokens[:T]], dtype=torch.int32)
        d_pre = float(np.abs(pre(ids, torch.zeros_like(ids))[0, 0].numpy() - official["logits"][T - 1]).max())
    print(f"rwkv7 head {head_dim}: decode module vs official {d_dec:.3g}, prefill ({T} tokens) {d_pre:.3g}")
    assert d_dec <= TOL and d_pre <= TOL, (d_dec, d_pre)
    assert all(m.eps == 64e-5 for m in dec.modules() if isinstance(m, torch.nn.GroupNorm))


def test_rwkv7_blinkdl_pth_through_the_source_stage(tmp_path):
    """A user's BlinkDL x070 .pth at head size 8 (no config.json) through the source stage: the
    normalised config.json states 64e-5 and the reader gives back the manifest's geometry."""
    import yaml

    from recurrent_coreai.checkpoints import reader
    from recurrent_coreai.families.rwkv7 import blinkdl
    from recurrent_coreai.stages.source import build_source

    g = R7.geometry_from_shape({"layers": 2, "hidden": 32, "head_dim": 8, "ffn": 64, "vocab": 65536,
                                "decay_lora": 4, "a_lora": 4, "v_lora": 4, "gate_lora": 4}, "test")
    src = tmp_path / "user"
    src.mkdir()
    torch.save(blinkdl.from_hf(dict(R7.synthetic_tensors(g, seed=2))), src / "model.pth")
    vocab_cfg = yaml.safe_load((REPO / "config.yaml").read_text())["vocab"]
    manifest = build_source("rwkv7-h8", {"family": "rwkv7", "source": {"kind": "path", "path": str(src)}},
                            vocab_cfg, tmp_path / "source")
    assert manifest["layout"] == "blinkdl"
    cfg = json.loads((tmp_path / "source" / "config.json").read_text())
    assert cfg["head_dim"] == 8 and cfg[_r7().G_NORM_EPS_KEY] == 64e-5
    back = reader.load_geometry(R7, tmp_path / "source")
    assert back == R7.geometry_from_dict(manifest["geometry"]) == g and back.g_norm_eps == 64e-5


# === Mamba-2: both RMSNorms take the file's layer_norm_epsilon (no finding; pinned) =================
def test_mamba2_norm_eps_from_the_file_matches_transformers(tmp_path):
    """transformers' Mamba2 uses config.layer_norm_epsilon for the block norms, norm_f AND the gated
    norm (grouped by I/G); mamba_ssm fixes the gated norm at 1e-5 (its layout refuses other values).
    At eps 1e-2, head size 16 and two groups, a fixed 1e-5 anywhere would show: the reference
    (taking the file's value) matches transformers' step path, the fixed-constant copy does not."""
    import dataclasses
    import logging

    from transformers import Mamba2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    m2 = get("mamba2")
    g = dataclasses.replace(m2.geometry_from_shape({"layers": 2, "hidden": 64, "d_state": 16, "headdim": 16,
                                                    "vocab": 256, "n_groups": 2}, "test"), norm_eps=1e-2)
    sd = dict(m2.synthetic_tensors(g, 3))
    m2.write_layout(sd, tmp_path, "hf", geom=g)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["layer_norm_epsilon"] == 1e-2 and m2.geometry_from_config(cfg, "config.json") == g
    model = Mamba2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    toks = torch.randint(0, g.vocab, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        cache, hf = None, []
        for t in toks:
            o = model(torch.tensor([[t]]), cache=cache, use_cache=True)
            cache = o.cache
            hf.append(o.logits[0, -1])
    hf = torch.stack(hf).numpy()
    d = float(np.abs(m2.reference(sd, g).run(toks)[0].numpy() - hf).max())
    d_fixed = float(np.abs(m2.reference(sd, dataclasses.replace(g, norm_eps=1e-5)).run(toks)[0].numpy() - hf).max())
    print(f"mamba2 eps 1e-2: reference vs transformers {d:.3g}; a fixed 1e-5 {d_fixed:.3g}")
    assert d <= TOL and not d_fixed <= TOL, (d, d_fixed)


# === Gated DeltaNet: the q/k L2 norm eps (no finding in value; one copy instead of two) =============
def test_gdn_l2_eps_is_fla_and_written_once():
    """fla-core 0.6.0 fixes the q/k L2 norm at x / sqrt(sum x^2 + 1e-6): l2norm_fwd's default (the chunk
    rule) and the literal in the fused_recurrent kernel, read from the pinned package's files (Triton is
    not importable here). The family writes it once (recurrence.L2_EPS); at a small norm (where it
    matters) its l2norm is that formula, not F.normalize's max(|x|, 1e-12)."""
    import ast
    import importlib.metadata as md
    import re

    from recurrent_coreai.families.gdn import geometry as gdn_geometry
    from recurrent_coreai.families.gdn import recurrence as rec

    dist = md.distribution("fla-core")
    assert dist.version == "0.6.0"
    l2 = ast.parse(Path(str(dist.locate_file("fla/modules/norm/l2norm.py"))).read_text())
    fwd = next(n for n in ast.walk(l2) if isinstance(n, ast.FunctionDef) and n.name == "l2norm_fwd")
    eps_default = dict(zip([a.arg for a in fwd.args.args][-len(fwd.args.defaults):], fwd.args.defaults))["eps"]
    assert ast.literal_eval(eps_default) == rec.L2_EPS == 1e-6
    kernel = Path(str(dist.locate_file("fla/ops/gated_delta_rule/fused_recurrent.py"))).read_text()
    assert re.findall(r"b_[qk] / tl\.sqrt\(tl\.sum\(b_[qk] \* b_[qk]\) \+ ([0-9.e-]+)\)", kernel) == ["1e-6", "1e-6"]
    assert not hasattr(gdn_geometry, "L2_EPS")
    x = torch.full((2, 16), 1e-4, dtype=torch.float64)                      # sum x^2 = 1.6e-7 < eps
    want = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    assert torch.allclose(rec.l2norm(x), want, rtol=1e-12, atol=0)
    assert not torch.allclose(rec.l2norm(x), torch.nn.functional.normalize(x, dim=-1), rtol=1e-3)
