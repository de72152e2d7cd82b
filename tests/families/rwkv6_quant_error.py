"""Measure (not a test): int8 weight error per quantisation role of RWKV-6, in the fp32 reference.

Each role's weights quantised int8 per block of 32 along the input axis, symmetric (scale =
max|w|/127 per block), then dequantised; the fp32 reference then runs a teacher-forced stream of
random tokens on the synthetic model, and max|dlogits| and top-1 flips are counted against the
unquantised reference (flips also counted only where the fp32 top-2 margin clears 0.1). Roles are
the family's (families/rwkv6 ``roles``), applied to the normal-form tensors they come from (the
LoRA matrices in their nn.Linear orientation).

usage: OMP_NUM_THREADS=1 python tests/families/rwkv6_quant_error.py [layers hidden tokens]
"""
from __future__ import annotations

import re
import sys

import torch

from recurrent_coreai.families import get
from recurrent_coreai.families.rwkv6.export_modules import module_parts
from recurrent_coreai.families.rwkv6.geometry import Geometry

FAM = get("rwkv6")
BLOCK = 32


def int8_blockwise(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the same after int8 per-block-32 (along in) symmetric quantisation."""
    out, n = w.shape
    if n % BLOCK:
        return w  # as coreai-opt: not quantised
    b = w.reshape(out, n // BLOCK, BLOCK)
    scale = b.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127.0
    return (torch.round(b / scale).clamp(-127, 127) * scale).reshape(out, n)


def quantise_role(sd: dict, role: str | None) -> tuple[dict, int]:
    out, n = dict(sd), 0
    for name, t in sd.items():
        parts = module_parts(name, t)
        if not parts[0][0].endswith(".weight") or t.dim() < 2 or name.endswith("embeddings.weight"):
            continue
        hit = [re.fullmatch(FAM.roles[r], p.rsplit(".", 1)[0]) for p, _ in parts for r in
               ([role] if role else FAM.roles)]
        if not any(hit):
            continue
        n += len(parts)
        if name.endswith("time_maa_w2"):
            out[name] = torch.stack([int8_blockwise(t[j].t()).t() for j in range(t.shape[0])])
        elif name.endswith(("time_maa_w1", "time_decay_w1", "time_decay_w2")):
            out[name] = int8_blockwise(t.t()).t().contiguous()
        else:
            out[name] = int8_blockwise(t)
    return out, n


def main(layers: int = 4, hidden: int = 512, n_tokens: int = 100) -> None:
    torch.set_num_threads(1)
    g = Geometry(layers=layers, hidden=hidden, ffn=int(hidden * 3.5) // 32 * 32, vocab=4096)
    sd = dict(FAM.synthetic_tensors(g, 17))
    tokens = torch.randint(0, g.vocab, (n_tokens,), generator=torch.Generator().manual_seed(2)).tolist()
    base, _ = FAM.reference(sd, g).run(tokens)
    top2 = torch.topk(base, 2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    print(f"geometry {g}; {n_tokens} tokens; fp32 logit scale {float(base.abs().max()):.1f}; "
          f"{int(clear.sum())} steps with top-2 margin > 0.1")
    print(f"{'role':14s} {'linears':>7s} {'max|dlogits|':>12s} {'top-1 flips':>11s} {'flips (margin>0.1)':>18s}")
    for role in [*FAM.roles, None]:
        q, n = quantise_role(sd, role)
        got, _ = FAM.reference(q, g).run(tokens)
        flips = got.argmax(-1) != base.argmax(-1)
        print(f"{role or 'all':14s} {n:7d} {float((got - base).abs().max()):12.4f} {int(flips.sum()):11d} "
              f"{int((flips & clear).sum()):18d}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
