"""RWKV-6 fp16 rescale (the rwkv package's ``RWKV_RESCALE_LAYER`` = 6; issue 21).

A deep synthetic model (13 layers: two rescale boundaries, weights of blocks 6-11 halved and of
block 12 quartered) whose ``feed_forward.value`` row of one channel is made all-positive and
MASSIVE x the init, so that channel of the residual stream grows through the layers as trained
LMs' "massive activations" do: true max|x| passes the fp16 maximum (65504) in the deep blocks
while the stored, rescaled one stays below it. The premise is asserted, not assumed.

* without the rescale the fp16 module overflows (inf in x -> NaN logits and NaN states, for good);
  with it (fp16's default) logits, both states and prefill match the fp32 reference;
* at the synthetic init's own scale (nothing near the fp16 range) the rescale changes nothing
  beyond fp16 noise, and fp32 is never rescaled (refused if asked; weights bit-equal to the
  checkpoint's), nor is anything below 7 layers;
* the Core AI runtime (fp16 bundle, decode) shows the same: test_rwkv6_fp16_rescale_coreai.py.

Measurement and numbers: docs/measurements/2026-12-01-rwkv6-fp16-rescale.md. Run as a script
(``python tests/families/test_rwkv6_fp16_rescale.py [layers] [x<N>|m<N>,...]``) for the per-block
max|x| table.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from recurrent_coreai.families import get
from recurrent_coreai.families.rwkv6 import export_modules as em
from recurrent_coreai.families.rwkv6.geometry import Geometry

FAM = get("rwkv6")
G = Geometry(layers=13, hidden=128, ffn=448, vocab=512, mix_lora=16, decay_lora=32)
FP16_MAX = 65504.0
CHANNEL = 7        # the massive channel
MASSIVE = 3000.0   # its ffn.value row: |w| * MASSIVE (true max|x| ~1e5 by block 12, measured)
TOKENS = torch.randint(0, G.vocab, (24,), generator=torch.Generator().manual_seed(3)).tolist()
STATES = ("recState", "shiftState")


def weights(g: Geometry = G, massive: float = 1.0, seed: int = 5, gain: float = 1.0) -> dict[str, torch.Tensor]:
    """The synthetic init; ``massive``: channel CHANNEL's ffn.value row |w| * massive in every block;
    ``gain``: every block's attention.output and feed_forward.value times gain (a uniform scale-up)."""
    sd = dict(FAM.synthetic_tensors(g, seed))
    if gain != 1.0:
        for i in range(g.layers):
            for name in em.RESCALED:
                sd[f"rwkv.blocks.{i}.{name}"] = sd[f"rwkv.blocks.{i}.{name}"] * gain
    if massive != 1.0:
        for i in range(g.layers):
            name = f"rwkv.blocks.{i}.feed_forward.value.weight"
            w = sd[name].clone()
            w[CHANNEL] = w[CHANNEL].abs() * massive
            sd[name] = w
    return sd


def run(dec, tokens) -> tuple[torch.Tensor, list[float]]:
    """``tokens`` through the decode module's own forward, one at a time, recording max|x| as each
    block returns it (stored, before that block's halving): (logits [T,V] fp32, per-block max|x|)."""
    xs = [0.0] * dec.g.layers

    def recorded(i, own):
        def step_(*args):
            out = own(*args)
            xs[i] = float(torch.maximum(torch.tensor(xs[i]), out[0].float().abs().max()))   # NaN stays NaN
            return out
        return step_

    blocks = list(dec.rwkv.blocks)
    for i, block in enumerate(blocks):
        block.step = recorded(i, block.step)       # an instance attribute over the method
    try:
        with torch.no_grad():
            logits = torch.stack([step(dec, t)[0, 0].float() for t in tokens])
    finally:
        for block in blocks:
            del block.step
    return logits, xs


def step(dec, t):
    return dec(torch.tensor([[t]], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32))


def reference(sd, g=G, tokens=TOKENS):
    ref = FAM.reference(sd, g)
    logits, state = ref.run(tokens)
    return torch.stack(list(logits)).float(), ref.bundle_states(state)


def state_errors(dec, want) -> dict[str, float]:
    """max|d| per state, relative to the reference state's max|.|."""
    return {n: float(np.abs(getattr(dec, n).float().numpy() - want[n]).max() / np.abs(want[n]).max()) for n in STATES}


@pytest.fixture(scope="module")
def massive():
    sd = weights(massive=MASSIVE)
    l32, x32 = run(FAM.build_decode(sd, G, torch.float32), TOKENS)
    return sd, l32, x32, reference(sd)


def test_premise_true_residual_passes_fp16_max_rescaled_one_does_not(massive):
    _, _, x32, _ = massive
    stored = [x / 2 ** (i // em.RESCALE_EVERY) for i, x in enumerate(x32)]   # block i's x, rescaled
    print(f"fp32 max|x| per block {[f'{x:.3g}' for x in x32]}; rescaled {[f'{x:.3g}' for x in stored]}")
    assert max(x32) > 1.3 * FP16_MAX
    assert max(stored) < 0.8 * FP16_MAX


def test_fp16_without_rescale_overflows(massive):
    sd, l32, _, _ = massive
    dec = em.build_decode(sd, G, torch.float16, rescale_every=0)
    l16, x16 = run(dec, TOKENS)
    bad = int((~torch.isfinite(l16)).any(1).sum())
    nan_states = {n: int(torch.isnan(getattr(dec, n)).sum()) for n in STATES}
    print(f"fp16 without rescale: stored max|x| {[f'{x:.3g}' for x in x16]}, non-finite logit rows "
          f"{bad}/{len(TOKENS)}, NaN state entries {nan_states}")
    assert float("inf") in x16
    assert bad >= len(TOKENS) // 2 and all(v > 0 for v in nan_states.values())


def test_fp16_rescaled_matches_reference(massive):
    sd, l32, _, (want, want_states) = massive
    dec = FAM.build_decode(sd, G, torch.float16)        # fp16: rescaled by default
    assert dec.rescale_every == em.RESCALE_EVERY
    l16, x16 = run(dec, TOKENS)
    assert max(x16) < FP16_MAX and torch.isfinite(l16).all()
    dl = float((l16 - want).abs().max())
    top1 = int((l16.argmax(1) == want.argmax(1)).sum())
    ds = state_errors(dec, want_states)
    print(f"fp16 rescaled vs fp32 reference: max|dlogits| {dl:.3g} (logits up to {float(want.abs().max()):.3g}), "
          f"top-1 {top1}/{len(TOKENS)}, states max|d|/max|ref| {ds}")
    assert dl < 0.05 and top1 == len(TOKENS)
    assert ds["shiftState"] < 5e-3 and ds["recState"] < 5e-3


def test_fp16_rescaled_prefill_matches_reference(massive):
    sd, _, _, (want, want_states) = massive
    dec = FAM.build_decode(sd, G, torch.float16)
    pre = FAM.build_prefill(dec, 12)
    assert pre.rescale_every == em.RESCALE_EVERY
    with torch.no_grad():
        out = [pre(ids := torch.tensor([TOKENS[c * 12:(c + 1) * 12]], dtype=torch.int32), torch.zeros_like(ids))
               for c in range(2)]
    got = torch.stack([o[0, 0].float() for o in out])
    dl = float((got - want[[11, 23]]).abs().max())
    ds = state_errors(dec, want_states)
    print(f"fp16 rescaled prefill (2 x 12) vs reference: max|dlogits| {dl:.3g}, states {ds}")
    assert torch.isfinite(got).all() and dl < 0.05
    assert ds["shiftState"] < 5e-3 and ds["recState"] < 5e-3


def test_rescale_neutral_at_the_synthetic_scale():
    """Nothing near the fp16 range: the rescale is exact (powers of two) but for LayerNorm's eps, so
    fp16 with and without it are equally far from fp32; its stored x is smaller, nothing else."""
    sd = weights()
    want, _ = reference(sd)
    on, x_on = run(FAM.build_decode(sd, G, torch.float16), TOKENS)
    off, x_off = run(em.build_decode(sd, G, torch.float16, rescale_every=0), TOKENS)
    d_on, d_off = float((on - want).abs().max()), float((off - want).abs().max())
    print(f"synthetic init, fp16 vs fp32 reference: max|dlogits| rescaled {d_on:.3g}, not {d_off:.3g}; "
          f"max|x| {max(x_off):.3g} (fp16 max {FP16_MAX:g})")
    assert max(x_off) < 100 and max(x_on) <= max(x_off)
    assert d_on < 0.5 and d_off < 0.5 and d_on < 1.5 * d_off + 0.02


def test_fp32_and_shallow_models_are_never_rescaled():
    sd = weights()
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        with pytest.raises(ValueError, match="fp16 only"):
            em.build_decode(sd, G, dtype, rescale_every=6)
        assert em.build_decode(sd, G, dtype).rescale_every == 0
    d32 = dict(FAM.build_decode(sd, G, torch.float32).named_parameters())
    d16 = dict(FAM.build_decode(sd, G, torch.float16).named_parameters())
    for i in range(G.layers):
        for name in em.RESCALED:
            key = f"rwkv.blocks.{i}.{name}"
            assert torch.equal(d32[key], sd[key])                                   # fp32: the checkpoint's bits
            assert torch.equal(d16[key], (sd[key] / 2 ** (i // 6)).half())          # fp16: / 2**(i//6), exactly
    assert torch.equal(d16["rwkv.blocks.0.attention.output.weight"], sd["rwkv.blocks.0.attention.output.weight"].half())
    # 6 layers or fewer: fp16 weights and forward as without the rescale (the last block's halving
    # only at exactly 6 layers, before ln_out)
    small = Geometry(layers=5, hidden=128, ffn=448, vocab=512, mix_lora=16, decay_lora=32)
    ssd = weights(small)
    a, b = FAM.build_decode(ssd, small, torch.float16), em.build_decode(ssd, small, torch.float16, rescale_every=0)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    with torch.no_grad():
        for t in TOKENS[:4]:
            assert torch.equal(step(a, t), step(b, t))


if __name__ == "__main__":
    # the measurement's per-block table: [layers] [case,...], a case "m<N>" (massive channel x N)
    # or "x<N>" (every block's output/value weights x N)
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    g = Geometry(layers=layers, hidden=256, ffn=896, vocab=1024, mix_lora=32, decay_lora=64)
    toks = torch.randint(0, g.vocab, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    for case in (sys.argv[2] if len(sys.argv) > 2 else "x1,x64,m100,m1000,m3000").split(","):
        value = float(case[1:])
        sd = weights(g, massive=value) if case[0] == "m" else weights(g, gain=value)
        l32, x32 = run(FAM.build_decode(sd, g, torch.float32), toks)
        print(f"{case}: fp32 max|x| per block {[f'{x:.3g}' for x in x32]}")
        for rs in (0, em.RESCALE_EVERY):
            dec = em.build_decode(sd, g, torch.float16, rescale_every=rs)
            l16, x16 = run(dec, toks)
            fin = torch.isfinite(l16).all(1)
            dl = float((l16[fin] - l32[fin]).abs().max()) if fin.any() else float("nan")
            top1 = float((l16.argmax(1) == l32.argmax(1)).float().mean())
            nan_states = {n: int(torch.isnan(getattr(dec, n)).sum()) for n in STATES}
            print(f"  fp16 rescale_every={rs}: stored max|x| {[f'{x:.3g}' for x in x16]}\n"
                  f"    non-finite logit rows {int((~fin).sum())}/{len(toks)}, max|dlogits| (finite rows) {dl:.3g}, "
                  f"top-1 {top1:.3f}, NaN state entries {nan_states}")
