"""The RWKV-6 reference against BlinkDL's official x060 RNN path (rwkv==0.8.32, strategy
``cpu fp32``), run in its own process on a .pth written by ``write_layout("blinkdl")``: logits
of every token and the final states (wkv, both token shifts) agree to 1e-4 (measured: 0.0, the
two fp32 paths are bit-identical on these shapes). Copies of the reference with one term broken
(decay sign, bonus u dropped, ln_x eps 1e-5 instead of 64e-5) each FAIL the same comparison.
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
from recurrent_coreai.families.rwkv6.geometry import Geometry
from recurrent_coreai.families.rwkv6.reference import Reference

FAM = get("rwkv6")
RUNNER = Path(__file__).with_name("rwkv6_official.py")
TOL = 1e-4          # fp32; the measured delta is 0.0
N_TOKENS = 72
SHAPES = {
    # two LoRA sizes (BlinkDL doubles them at n_embd 4096: read off the tensors, never assumed)
    "lora16x32": Geometry(layers=2, hidden=128, ffn=448, vocab=512, mix_lora=16, decay_lora=32),
    "lora32x64": Geometry(layers=3, hidden=192, ffn=672, vocab=300, mix_lora=32, decay_lora=64),
}


def run_official(pth: Path, tokens: list[int], tmp: Path) -> dict[str, np.ndarray]:
    (tmp / "tokens.json").write_text(json.dumps(tokens))
    env = {k: v for k, v in os.environ.items() if k != "RWKV_V7_ON"}
    env.update(RWKV_JIT_ON="0", RWKV_CUDA_ON="0", OMP_NUM_THREADS="1")
    out = tmp / "official.npz"
    res = subprocess.run([sys.executable, str(RUNNER), str(pth), str(tmp / "tokens.json"), str(out)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return dict(np.load(out))


def deltas(ref: Reference, tokens: list[int], official: dict[str, np.ndarray]) -> dict[str, float]:
    logits, state = ref.run(tokens)
    b = ref.bundle_states(state)
    return {
        "logits": float(np.abs(logits.float().numpy() - official["logits"]).max()),
        "wkv": float(np.abs(b["recState"][:, 0] - official["wkv"]).max()),
        "att_shift": float(np.abs(b["shiftState"][:, 0, 0] - official["att_shift"]).max()),
        "ffn_shift": float(np.abs(b["shiftState"][:, 0, 1] - official["ffn_shift"]).max()),
    }


def agrees(d: dict[str, float]) -> bool:
    return all(v <= TOL for v in d.values())   # a NaN fails too


class DecaySign(Reference):
    def decay(self, d):
        return torch.exp(-torch.exp(-d))


class NoBonus(Reference):
    def wkv_head(self, r, k, v, w, u, S):
        return super().wkv_head(r, k, v, w, torch.zeros_like(u), S)


class LnXEps(Reference):
    ln_x_eps = 1e-5


@pytest.fixture(scope="module", params=sorted(SHAPES))
def case(request, tmp_path_factory):
    g = SHAPES[request.param]
    sd = dict(FAM.synthetic_tensors(g, seed=11))
    tmp = tmp_path_factory.mktemp(request.param)
    pth = FAM.write_layout(sd, tmp, "blinkdl")
    tokens = torch.randint(0, g.vocab, (N_TOKENS,), generator=torch.Generator().manual_seed(5)).tolist()
    return request.param, g, sd, tokens, run_official(pth, tokens, tmp)


def test_reference_matches_official(case):
    name, g, sd, tokens, official = case
    assert official["logits"].shape == (N_TOKENS, g.vocab)
    assert official["wkv"].shape == (g.layers, g.heads, g.head_dim, g.head_dim)
    assert np.abs(official["wkv"]).max() > 1.0   # the state is really exercised
    d = deltas(FAM.reference(sd, g), tokens, official)
    print(f"{name}: reference vs rwkv 0.8.32 x060 cpu fp32 over {N_TOKENS} tokens: {d}")
    assert agrees(d), d


def test_reference_fp64_matches_official(case):
    name, g, sd, tokens, official = case
    d = deltas(FAM.reference(sd, g, torch.float64), tokens, official)
    print(f"{name}: fp64 reference vs official fp32: {d}")
    assert d["logits"] < 1e-3 and d["wkv"] < 1e-3, d


@pytest.mark.parametrize("broken", [DecaySign, NoBonus, LnXEps], ids=lambda c: c.__name__)
def test_broken_reference_fails(case, broken):
    name, g, sd, tokens, official = case
    d = deltas(broken(sd, g), tokens, official)
    print(f"{name}: {broken.__name__} vs official: {d}")
    assert not agrees(d), f"{broken.__name__} passed the official comparison: {d}"
