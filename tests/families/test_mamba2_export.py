"""The Mamba-2 export modules in eager torch: decode against the reference, prefill (SSD chunk
form) against decode steps, and one write per state per call in the torch.export graphs."""

from __future__ import annotations

import pytest
import torch

from mamba2_common import FAMILY, SHAPES, decode_steps, geometry, prefill, tokens, weights
from ssm_common import max_state_delta, states
from recurrent_coreai.coreai.entrypoints import DECODE, PREFILL, by_role
from recurrent_coreai.families.mamba2.export_modules import MAX_CHUNK, STATE_NAMES

TOL_LOGITS = 1e-4
TOL_STATE = 1e-5


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model(request):
    g = geometry(request.param)
    sd = weights(g, seed=5)
    return request.param, g, sd, FAMILY.build_decode(sd, g, torch.float32)


def test_decode_matches_reference(model):
    name, g, sd, dec = model
    dec.reset()
    toks = tokens(80, g.vocab)
    got = decode_steps(dec, toks)
    ref = FAMILY.reference(sd, g)
    want, st = ref.run(toks)
    dl, ds = float((got - want).abs().max()), max_state_delta(states(dec), ref.bundle_states(st))
    print(f"\ndecode vs reference, {name}, 80 steps: max|dlogits| {dl:.2e}, max|dstate| {ds:.2e}")
    assert dl < TOL_LOGITS and ds < TOL_STATE
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("T", [1, 7, 16, 64, 128, MAX_CHUNK])
def test_prefill_equals_decode_steps(model, T):
    name, g, sd, dec = model
    toks = tokens(T + 5, g.vocab, seed=T)
    warm, chunk = toks[:5], toks[5:]
    dec.reset()
    decode_steps(dec, warm)                      # a non-zero state before the chunk
    want = decode_steps(dec, chunk)[-1]
    want_states = states(dec)
    dec.reset()
    decode_steps(dec, warm)
    got = prefill(dec, chunk)
    dl, ds = float((got - want).abs().max()), max_state_delta(states(dec), want_states)
    print(f"\nprefill T={T} vs {T} decode steps, {name}: max|dlogits| {dl:.2e}, max|dstate| {ds:.2e}")
    assert dl < TOL_LOGITS and ds < TOL_STATE


def test_prefill_across_chunk_boundaries(model):
    """Two 16-token prefill calls, then decode (the state carried across calls: the conv window
    and the SSM state) equal 40 decode steps; from a zero state, too short for the conv window
    (T=2 < K) as well."""
    name, g, sd, dec = model
    toks = tokens(40, g.vocab, seed=9)
    dec.reset()
    want = decode_steps(dec, toks)
    want_states = states(dec)
    dec.reset()
    prefill(dec, toks[:2])
    prefill(dec, toks[2:18])
    l1 = prefill(dec, toks[18:34])
    assert float((l1 - want[33]).abs().max()) < TOL_LOGITS
    rest = decode_steps(dec, toks[34:])
    dl, ds = float((rest - want[34:]).abs().max()), max_state_delta(states(dec), want_states)
    print(f"\nprefill 2+16+16 then 6 decode steps vs 40 decode steps, {name}: {dl:.2e}, {ds:.2e}")
    assert dl < TOL_LOGITS and ds < TOL_STATE


def test_fp64_graph_and_fp16_graph(model):
    """fp64 graph = fp64 reference closely; fp16 graph stays near (recurrence in fp32 inside)."""
    name, g, sd, _ = model
    toks = tokens(24, g.vocab, seed=4)
    want, _ = FAMILY.reference(sd, g, torch.float64).run(toks)
    d64 = FAMILY.build_decode(sd, g, torch.float64)
    assert float((decode_steps(d64, toks) - want).abs().max()) < 1e-9
    d16 = FAMILY.build_decode(sd, g, torch.float16)
    assert d16.ssmState.dtype == torch.float16
    got16 = decode_steps(d16, toks).double()
    scale = float(want.abs().max())
    print(f"\nfp16 graph vs fp64 reference, {name}: max|dlogits| {float((got16 - want).abs().max()):.3f} "
          f"(logit scale {scale:.1f})")
    assert float((got16 - want).abs().max()) < 0.02 * scale


def test_each_linear_sees_every_linear_once(model):
    name, g, sd, _ = model
    seen = []
    FAMILY.build_decode(sd, g, torch.float32, lambda n, lin: seen.append(n) or lin)
    assert sorted(seen) == sorted([f"backbone.layers.{i}.mixer.{p}" for i in range(g.layers)
                                   for p in ("in_proj", "out_proj")] + ["lm_head"])
    import re

    for role, pattern in FAMILY.roles.items():
        hits = [n for n in seen if re.fullmatch(pattern, n)]
        assert len(hits) == {"lm_head": 1, "mlp": 0, "mixer_output": g.layers, "state_inputs": g.layers}[role]


def test_build_decode_is_strict(model):
    name, g, sd, _ = model
    with pytest.raises(KeyError, match="missing weights"):
        FAMILY.build_decode({n: t for n, t in sd.items() if not n.endswith("A_log")}, g, torch.float32)
    with pytest.raises(KeyError, match="unexpected weight"):
        FAMILY.build_decode({**sd, "backbone.layers.0.mixer.bogus": torch.zeros(1)}, g, torch.float32)


def test_meta_skeleton_builds(model):
    """Meta weights (names and shapes only) build a complete skeleton: what a quantisation plan is made from."""
    name, g, sd, _ = model
    meta = ((n, torch.empty(s, device="meta")) for n, s in FAMILY.normal_shapes(g).items())
    sk = FAMILY.build_decode(meta, g, torch.float16)
    assert sk.lm_head.weight.is_meta and sk.lm_head.weight.shape == (g.vocab, g.hidden)


@pytest.mark.parametrize("chunk", [1, 16])
def test_one_write_per_state_in_the_export_graph(model, chunk):
    try:
        from recurrent_coreai.coreai.convert import state_writes
    except ImportError:  # before the lead's move of the conversion into coreai/convert.py
        from recurrent_coreai.stages.export import state_writes

    name, g, sd, dec = model
    dec.reset()
    mod = dec if chunk == 1 else FAMILY.build_prefill(dec, chunk)
    ep = torch.export.export(mod, by_role(DECODE if chunk == 1 else PREFILL).example_inputs(chunk))
    assert state_writes(ep, STATE_NAMES) == {"convState": 1, "ssmState": 1}
    assert [s.name for s in FAMILY.state_specs(g)] == list(STATE_NAMES)
    assert {s.name: s.shape for s in FAMILY.state_specs(g)} == {n: tuple(getattr(dec, n).shape) for n in STATE_NAMES}
