#!/usr/bin/env python3
"""Where a quantised recipe's logit error comes from, in the fp32 reference (no Core AI).

    python bench/bench_quant_error.py --source DIR --stream stream.npz [--recipe int8keepproj]
                                      [--steps N] [--variants all head ffn noise ...] [--json PATH]

RWKV-7 only (it swaps weights inside the RWKV-7 fp32 reference; for RWKV-6 and Mamba-2 see
tests/families/rwkv6_quant_error.py and mamba2_quant_error.py). ``DIR`` is a source stage output
of an rwkv7 model (model.safetensors + config.json) and ``stream.npz`` the
reference stage's stream for it (results/<model>/reference/stream.npz): the tokens fed at each
step and the fp32 logits that came out. Each variant replaces some weights and feeds the same
tokens (teacher forcing, state reset where the stream starts a prompt), then compares its logits
with the stream's:

- ``all``: every weight the recipe quantises, quantised and dequantised in fp32 (symmetric,
  per block of ``block_size`` along the input axis, scale absmax / (2^(bits-1) - 1), round to
  nearest): the recipe's error alone, without fp16 or the runtime;
- ``head`` / ``ffn``: the same for lm_head only, or the FFN key/value linears only;
- ``noise``: Gaussian noise of the same per-element rms as ``all``'s error, in each block: is it
  the size of the error or its structure that matters?
- ``early`` / ``late``: ``ffn`` in the first / last third of the layers only (how much the error
  grows through depth).

Printed per variant: relative weight error (rms of the change / rms of the weights), max|dlogits|
median and max over steps, top-1 flips and the smallest reference top-2 margin among them, and how
many steps have a reference margin below that step's max|dlogits| ("at risk").
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recurrent_coreai import families  # noqa: E402
from recurrent_coreai.checkpoints.reader import load_checkpoint  # noqa: E402
from recurrent_coreai.coreai import quantize  # noqa: E402
from recurrent_coreai.families.rwkv7.reference import Reference  # noqa: E402

FAMILY = families.get("rwkv7")


def fake_quant(w: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Quantise-dequantise ``w`` [out, in] per block of ``block`` input columns, in fp32."""
    out_f, in_f = w.shape
    qmax = 2 ** (bits - 1) - 1
    res = torch.empty_like(w, dtype=torch.float32)
    for at in range(0, out_f, 1024):  # row slices: no second full fp64/fp32 temporary
        b = w[at:at + 1024].float().reshape(-1, in_f // block, block)
        scale = b.abs().amax(-1, keepdim=True).clamp_min(1e-30) / qmax
        res[at:at + 1024] = (torch.round(b / scale).clamp(-qmax, qmax) * scale).reshape(-1, in_f)
    return res


def matched_noise(w: torch.Tensor, q: torch.Tensor, block: int, gen: torch.Generator) -> torch.Tensor:
    """``w`` plus Gaussian noise with the rms of ``q - w`` in each block."""
    out_f, in_f = w.shape
    res = torch.empty_like(w, dtype=torch.float32)
    for at in range(0, out_f, 1024):
        d = (q[at:at + 1024] - w[at:at + 1024]).reshape(-1, in_f // block, block)
        rms = d.pow(2).mean(-1, keepdim=True).sqrt()
        n = torch.randn(d.shape, generator=gen) * rms
        res[at:at + 1024] = w[at:at + 1024] + n.reshape(-1, in_f)
    return res


def selected(names, include: list[str], exclude: list[str], layers: set[int] | None) -> list[str]:
    """Weight names the recipe's patterns choose (as quantize.plan matches them), in ``layers``."""
    out = []
    for n in names:
        linear = n.removesuffix(".weight")
        if linear == n or not quantize.matching_pattern(linear, include) or quantize.matching_pattern(linear, exclude):
            continue
        m = re.match(r"model\.layers\.(\d+)\.", n)
        if layers is not None and (m is None or int(m.group(1)) not in layers):
            continue
        out.append(n)
    return out


def run_variant(ref: Reference, stream, steps: int) -> np.ndarray:
    state, out = None, []
    for i in range(steps):
        if i == 0 or stream["pos"][i] == 0:
            state = ref.zero_state()
        out.append(ref.step(int(stream["tokens"][i]), state).numpy())
    return np.stack(out)


def compare(logits: np.ndarray, ref_logits: np.ndarray) -> dict:
    d = np.abs(logits - ref_logits).max(1)
    top2 = np.argsort(ref_logits, 1)[:, -2:]
    margin = ref_logits[np.arange(len(d)), top2[:, 1]] - ref_logits[np.arange(len(d)), top2[:, 0]]
    flips = np.flatnonzero(logits.argmax(1) != top2[:, 1])
    return {"max_abs_dlogits_median": float(np.median(d)), "max_abs_dlogits_max": float(d.max()),
            "flips": int(len(flips)), "flip_steps": flips.tolist(),
            "flip_min_margin": float(margin[flips].min()) if len(flips) else None,
            "at_risk": int((margin < d).sum()), "steps": int(len(d)),
            "margin_p10": float(np.percentile(margin, 10)), "margin_median": float(np.median(margin))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", type=Path, required=True)
    ap.add_argument("--stream", type=Path, required=True)
    ap.add_argument("--recipe", default="int8keepproj")
    ap.add_argument("--steps", type=int, default=None, help="default: the whole stream")
    ap.add_argument("--variants", nargs="+", default=["all", "head", "ffn", "noise", "early", "late"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ns = ap.parse_args()

    q = yaml.safe_load((ROOT / "config.yaml").read_text())["recipes"][ns.recipe]["quantize"]
    q = quantize.resolve_roles(q, FAMILY.roles, ns.recipe)  # a recipe by roles -> RWKV-7's patterns
    stream = dict(np.load(ns.stream))
    steps = ns.steps or len(stream["tokens"])
    geom, weights = load_checkpoint(ns.source, family=FAMILY)
    ref = FAMILY.reference(weights, geom, torch.float32)
    if not isinstance(ref, Reference):
        raise SystemExit("error: the rwkv7 family's reference is not families.rwkv7.reference.Reference -- "
                         "fix: update bench_quant_error.py to the family's reference")
    base = dict(ref.w)
    L = geom.layers
    groups = {
        "all": (q["include"], None),
        "head": (["lm_head"], None),
        "ffn": ([p for p in q["include"] if "ffn" in p], None),
        "noise": (q["include"], None),
        "early": ([p for p in q["include"] if "ffn" in p], set(range(max(1, L // 3)))),
        "late": ([p for p in q["include"] if "ffn" in p], set(range(L - max(1, L // 3), L))),
    }
    rows = []
    gen = torch.Generator().manual_seed(ns.seed)
    for v in ns.variants:
        include, layers = groups[v]
        names = selected(base, include, q.get("exclude", []), layers)
        t0 = time.time()
        num = den = 0.0
        ref.w = dict(base)
        for n in names:
            qw = fake_quant(base[n], q["bits"], q["block_size"])
            if v == "noise":
                qw = matched_noise(base[n], qw, q["block_size"], gen)
            num += float((qw - base[n]).double().pow(2).sum())
            den += float(base[n].double().pow(2).sum())
            ref.w[n] = qw
        row = {"variant": v, "weights": len(names), "rel_weight_error": (num / den) ** 0.5,
               **compare(run_variant(ref, stream, steps), stream["logits"][:steps]),
               "seconds": round(time.time() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    ref.w = base
    if ns.json:
        ns.json.write_text(json.dumps({"source": str(ns.source), "recipe": ns.recipe, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
