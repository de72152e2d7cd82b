"""RWKV-6 export modules in eager torch: decode equals the reference over 80 steps; prefill of T
tokens equals T decode steps (last logits and both states) at T = 1, 7, 16, 64 and across a chunk
boundary (two chunks in a row), also with strong decays (w down to e^-20: the log-decay sums over
a chunk reach hundreds); each state is written exactly once per call in the torch.export graph of
both modules; build_decode hands every nn.Linear to each_linear once; the roles cover the linears.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

from recurrent_coreai.coreai.convert import state_writes
from recurrent_coreai.coreai.entrypoints import DECODE, PREFILL, by_role
from recurrent_coreai.families import get
from recurrent_coreai.families.rwkv6.geometry import Geometry

FAM = get("rwkv6")
G = Geometry(layers=2, hidden=128, ffn=448, vocab=512, mix_lora=16, decay_lora=32)
STATES = tuple(s.name for s in FAM.state_specs(G))
TOKENS = torch.randint(0, G.vocab, (400,), generator=torch.Generator().manual_seed(9)).tolist()


@pytest.fixture(scope="module")
def sd():
    return dict(FAM.synthetic_tensors(G, 21))


def strong(sd):
    """time_decay up to +3: w = exp(-exp(3)) = 2e-9 on some channels, 0.9997 on others."""
    out = dict(sd)
    for i in range(G.layers):
        out[f"rwkv.blocks.{i}.attention.time_decay"] = torch.linspace(-8.0, 3.0, G.hidden).reshape(1, 1, -1)
    return out


def step(dec, t):
    return dec(torch.tensor([[t]], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32))


def test_decode_equals_reference(sd):
    ref = FAM.reference(sd, G)
    dec = FAM.build_decode(sd, G, torch.float32)
    assert tuple(dec.recState.shape) == FAM.state_specs(G)[0].shape
    state = ref.zero_state()
    worst = 0.0
    with torch.no_grad():
        for t in TOKENS[:80]:
            out = step(dec, t)
            assert out.shape == (1, 1, G.vocab)
            worst = max(worst, float((out[0, 0] - ref.step(t, state)).abs().max()))
    b = ref.bundle_states(state)
    ds = {n: float(np.abs(getattr(dec, n).numpy() - b[n]).max()) for n in STATES}
    print(f"decode vs reference, 80 steps fp32: max|dlogits| {worst:.2e}, states {ds}")
    assert worst < 1e-4 and all(v < 1e-4 for v in ds.values())


def prefill_vs_decode(weights, T, dtype, n_chunks=1, warm=5):
    """(max|dlogits|, max|drecState|, max|dshiftState|) between n_chunks prefill calls of T tokens
    and the same tokens through decode, from a state warmed by ``warm`` decode steps."""
    dec = FAM.build_decode(weights, G, dtype)
    pre = FAM.build_prefill(dec, T)
    seq = TOKENS[warm:warm + n_chunks * T]
    with torch.no_grad():
        for t in TOKENS[:warm]:
            step(dec, t)
        start = (dec.recState.clone(), dec.shiftState.clone())
        for c in range(n_chunks):
            ids = torch.tensor([seq[c * T:(c + 1) * T]], dtype=torch.int32)
            lp = pre(ids, torch.zeros_like(ids))
        got = (dec.recState.clone(), dec.shiftState.clone())
        dec.recState.copy_(start[0])
        dec.shiftState.copy_(start[1])
        for t in seq:
            ld = step(dec, t)
    assert lp.shape == (1, 1, G.vocab)
    return (float((lp - ld).abs().max()), float((got[0] - dec.recState).abs().max()),
            float((got[1] - dec.shiftState).abs().max()))


@pytest.mark.parametrize("decays", ["synthetic", "strong"])
@pytest.mark.parametrize("T,n_chunks", [(1, 1), (7, 1), (16, 1), (64, 1), (64, 2), (16, 3), (128, 1)])
def test_prefill_equals_decode(sd, T, n_chunks, decays):
    w = sd if decays == "synthetic" else strong(sd)
    d32 = prefill_vs_decode(w, T, torch.float32, n_chunks)
    d64 = prefill_vs_decode(w, T, torch.float64, n_chunks)
    print(f"prefill T={T} x{n_chunks} ({decays}): fp32 {d32}, fp64 {d64}")
    assert all(np.isfinite(d32)) and max(d32) < 1e-3     # fp32 summation order only
    assert max(d64) < 1e-9                                # exact in exact arithmetic


def test_strong_decay_wkv_chunk_has_no_overflow():
    """A chunk whose every decay is ~0 (log w = -50 per token: -3200 summed over 64) stays finite
    and equals the step-by-step recurrence."""
    from recurrent_coreai.families.rwkv6.chunked import wkv6_chunk

    gen = torch.Generator().manual_seed(0)
    H, T, N = 2, 64, 8
    r, k, v = (torch.randn(H, T, N, generator=gen, dtype=torch.float64) for _ in range(3))
    logw = -torch.rand(H, T, N, generator=gen, dtype=torch.float64) * 50.0
    u = torch.randn(H, N, generator=gen, dtype=torch.float64)
    S = torch.randn(H, N, N, generator=gen, dtype=torch.float64)
    o, S_T = wkv6_chunk(r.float(), k.float(), v.float(), logw.float(), u.float(), S.float())
    want, Sr = [], S.clone()
    for t in range(T):
        kv = k[:, t, :, None] * v[:, t, None, :]
        want.append(torch.einsum("hk,hkv->hv", r[:, t], u[:, :, None] * kv + Sr))
        Sr = kv + torch.exp(logw[:, t, :, None]) * Sr
    assert torch.isfinite(o).all() and torch.isfinite(S_T).all()
    assert float((o.double() - torch.stack(want, 1)).abs().max()) < 2e-5
    assert float((S_T.double() - Sr).abs().max()) < 2e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_each_state_written_once(sd, dtype):
    dec = FAM.build_decode(sd, G, dtype)
    for module, inputs in [(dec, by_role(DECODE).example_inputs()),
                           (FAM.build_prefill(dec, 16), by_role(PREFILL).example_inputs(16))]:
        ep = torch.export.export(module, inputs)
        assert state_writes(ep, STATES) == {n: 1 for n in STATES}
        assert set(ep.run_decompositions().graph_signature.buffers_to_mutate.values()) == set(STATES)


def test_build_decode_each_linear_and_roles(sd):
    seen = []

    def each(name, lin):
        assert isinstance(lin, nn.Linear) and not lin.weight.is_meta
        seen.append(name)
        return lin

    dec = FAM.build_decode(sd, G, torch.float32, each_linear=each)
    linears = [n for n, m in dec.named_modules() if isinstance(m, nn.Linear)]
    assert sorted(seen) == sorted(linears) and len(seen) == len(set(seen))
    pre = FAM.build_prefill(dec, 8)
    assert dict(pre.named_parameters()).keys() == dict(dec.named_parameters()).keys()
    assert all(p is q for p, q in zip(pre.parameters(), dec.parameters()))
    assert dec.rwkv.blocks[0].attention.time_decay.dtype == torch.float32
    roles = {role: [n for n in linears if re.fullmatch(rx, n)] for role, rx in FAM.roles.items()}
    assert roles["lm_head"] == ["head"]
    assert len(roles["mlp"]) == 3 * G.layers and len(roles["mixer_output"]) == G.layers
    assert len(roles["state_inputs"]) == (4 + 1 + 5 + 2) * G.layers
    assert sorted(sum(roles.values(), [])) == sorted(linears)      # each linear has exactly one role
    # the LoRA linears hold the normal form's matrices transposed
    a = dec.rwkv.blocks[1].attention
    assert torch.equal(a.maa_w1.weight, sd["rwkv.blocks.1.attention.time_maa_w1"].t())
    assert torch.equal(a.maa_w2[3].weight, sd["rwkv.blocks.1.attention.time_maa_w2"][3].t())
    with pytest.raises(KeyError, match="unexpected weight"):
        FAM.build_decode({**sd, "rwkv.blocks.0.attention.bogus": torch.zeros(1)}, G, torch.float32)
    with pytest.raises(KeyError, match="missing weights"):
        FAM.build_decode({k: v for k, v in sd.items() if k != "head.weight"}, G, torch.float32)
