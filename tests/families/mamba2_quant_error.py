"""Measure: int8 weight error per quantisation role on a synthetic Mamba-2 (not a test).

Each role (families/mamba2 roles: lm_head, mixer_output = out_proj, state_inputs = in_proj) is
quantised alone -- int8, per block of 32 along the input axis, symmetric (scale = max|w|/127) --
dequantised, and the fp32 reference run teacher-forced over ~100 tokens of the synthetic
tokenizer's corpus: max|dlogits| and top-1 flips against the unquantised fp32 reference (flips
also counted only where the reference's top-2 margin clears 0.1).

    OMP_NUM_THREADS=1 .venv/bin/python tests/families/mamba2_quant_error.py
"""

from __future__ import annotations

import re

import torch

from recurrent_coreai.families import get
from recurrent_coreai.tokenizers import bpe

BLOCK = 32


def int8_blockwise(w: torch.Tensor) -> torch.Tensor:
    out_f, in_f = w.shape
    blocks = w.double().reshape(out_f, in_f // BLOCK, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.clamp(torch.round(blocks / torch.where(scale > 0, scale, 1)), -127, 127)
    return (q * scale).reshape(out_f, in_f).float()


def main() -> None:
    fam = get("mamba2")
    tok = bpe.synthetic()
    ids = tok.encode(bpe.SYNTHETIC_CORPUS)[:100]
    shape = {"layers": 4, "hidden": 256, "d_state": 64, "headdim": 32, "n_groups": 2, "vocab": tok.vocab_size}
    g = fam.geometry_from_shape(shape, "quant")
    sd = dict(fam.synthetic_tensors(g, 0))
    base, _ = fam.reference(sd, g).run(ids)
    top2 = base.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    print(f"shape {shape}, {len(ids)} tokens teacher-forced; logit std {float(base.std()):.2f}")
    for role, pattern in fam.roles.items():
        names = [n for n in sd if n.endswith(".weight") and re.fullmatch(pattern, n.removesuffix(".weight"))]
        if not names:
            print(f"  {role:13s} matches nothing")
            continue
        q = {n: (int8_blockwise(t) if n in names else t) for n, t in sd.items()}
        got, _ = fam.reference(q, g).run(ids)
        flips = got.argmax(-1) != base.argmax(-1)
        print(f"  {role:13s} ({len(names)} linears) int8/32: max|dlogits| {float((got - base).abs().max()):.4f}, "
              f"top-1 flips {int(flips.sum())}/{len(ids)} ({int((flips & clear).sum())} where margin > 0.1)")


if __name__ == "__main__":
    main()
