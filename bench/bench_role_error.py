#!/usr/bin/env python3
"""int8 weight error per quantisation role, any family, in its fp32 reference (no Core AI).

    OMP_NUM_THREADS=1 python bench/bench_role_error.py --family gdn \
        [--shape '{"layers": 4, "hidden": 256, ...}' | --checkpoint PATH] [--text FILE] [--tokens 100]
        [--seed 0] [--json PATH]

Each role of the family (``Family.roles``: lm_head, mlp, mixer_output, state_inputs) is quantised
alone -- int8, per block of 32 along the input axis, symmetric (scale = max|w|/127, round to
nearest), dequantised -- and the fp32 reference is run teacher-forced over a fixed pseudo-random
token stream (seed 1): max|dlogits| and top-1 flips against the unquantised fp32 reference (flips
also counted only where the reference's top-2 margin clears 0.1, the gate's near-tie epsilon).
Without ``--shape``: the family's ``tiny_shape`` widened to 4 layers where it has the key. A tied
head (``Family.tied_linears``) is reported but a recipe's roles keep it unquantised.
``--checkpoint``: a trained model's file or folder instead (read by the project's checkpoint reader,
e.g. fixtures/trained/mamba1); ``--text``: the first ``--tokens`` bytes of a text file as the token
stream (byte-level models: id = byte value) instead of pseudo-random ids.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recurrent_coreai import families  # noqa: E402

BLOCK = 32


def int8_blockwise(w: torch.Tensor) -> torch.Tensor:
    out_f, in_f = w.shape
    blocks = w.double().reshape(out_f, in_f // BLOCK, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.clamp(torch.round(blocks / torch.where(scale > 0, scale, 1)), -127, 127)
    return (q * scale).reshape(out_f, in_f).float()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", required=True)
    ap.add_argument("--shape", type=json.loads, default=None)
    ap.add_argument("--checkpoint", type=Path, default=None, help="a trained model instead of synthetic weights")
    ap.add_argument("--text", type=Path, default=None, help="the token stream: this file's first bytes")
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    fam = families.get(ns.family)
    if ns.checkpoint is not None:
        from recurrent_coreai.checkpoints.reader import load_checkpoint

        g, sd = load_checkpoint(ns.checkpoint, family=fam)
        sd, shape = dict(sd), str(ns.checkpoint)
    else:
        shape = ns.shape or {**fam.tiny_shape, **({"layers": 4} if "layers" in fam.tiny_shape else {})}
        g = fam.geometry_from_shape(shape, "--shape")
        sd = dict(fam.synthetic_tensors(g, ns.seed))
    if ns.text is not None:
        ids = list(ns.text.read_bytes()[: ns.tokens])
    else:
        ids = torch.randint(0, g.vocab, (ns.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    base, _ = fam.reference(sd, g).run(ids)
    top2 = base.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    print(f"{ns.family} shape {shape}, {len(ids)} tokens teacher-forced; logit std {float(base.std()):.2f}")
    rows = []
    tied = set(fam.tied_linears(g))
    for role, pattern in fam.roles.items():
        names = [n for n in sd if n.endswith(".weight") and sd[n].dim() == 2
                 and re.fullmatch(pattern, n.removesuffix(".weight")) and sd[n].shape[1] % BLOCK == 0]
        # (a linear whose input width is not a multiple of the block stays unquantised, as the
        # export keeps it: coreai/quantize.py -- e.g. Mamba-1's dt_proj at dt_rank 12)
        if not names:
            print(f"  {role:13s} matches nothing")
            continue
        q = {n: (int8_blockwise(t) if n in names else t) for n, t in sd.items()}
        got, _ = fam.reference(q, g).run(ids)
        flips = got.argmax(-1) != base.argmax(-1)
        row = {"role": role, "linears": len(names), "max_abs_dlogits": float((got - base).abs().max()),
               "flips": int(flips.sum()), "flips_clear": int((flips & clear).sum()), "tokens": len(ids),
               "tied": sorted(n.removesuffix(".weight") for n in names if n.removesuffix(".weight") in tied)}
        rows.append(row)
        print(f"  {role:13s} ({len(names)} linears) int8/32: max|dlogits| {row['max_abs_dlogits']:.4f}, "
              f"top-1 flips {row['flips']}/{len(ids)} ({row['flips_clear']} where margin > 0.1)"
              + (f"; tied: {row['tied']}" if row["tied"] else ""))
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps({"family": ns.family, "shape": shape, "roles": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
