#!/usr/bin/env python3
"""Where a quantised recipe's error comes from, in the fp32 reference (no Core AI), any family.

    python bench/bench_quant_error.py --source DIR --stream stream.npz [--family rwkv7]
                                      [--recipe int8keepproj] [--steps N]
                                      [--variants all noise early late <role> ...] [--json PATH]

``DIR`` is a source stage output (model.safetensors + config.json) of a model of ``--family``
(rwkv7 by default) and ``stream.npz`` the reference stage's stream for it
(results/<model>/reference/stream.npz): the tokens fed at each step and the fp32 logits that came
out, and the prefill check's states. Each variant replaces some weights of the family's fp32
reference (families/<family>/reference.py) and feeds the same tokens (teacher forcing, state reset
where the stream starts a prompt), then compares its logits with the stream's; it also feeds the
prefill check's continuous stream (stages/reference.prefill_stream, as the reference stage does) and
compares the states after it with the stream's, as the gate's ``prefill_max_rel_dstate`` does
(largest |difference| over the state's largest magnitude, per state, worst position):

- ``none``: no weight changed (the stream's own numbers: every difference 0);
- ``all``: every weight the recipe quantises (its roles resolved for the family, a tied head kept as
  the export's plan keeps it), quantised and dequantised in fp32 (symmetric, per block of
  ``block_size`` along the input axis, scale absmax / (2^(bits-1) - 1), round to nearest): the
  recipe's error alone, without fp16 or the runtime;
- ``<role>`` (e.g. ``lm_head``, ``mlp``, ``mixer_output``): the same for one of the recipe's roles;
- ``noise``: Gaussian noise of the same per-element rms as ``all``'s error, in each block: is it
  the size of the error or its structure that matters?
- ``early`` / ``late``: ``all`` in the first / last third of the layers only (how much the error
  grows through depth).

Printed per variant: relative weight error (rms of the change / rms of the weights), max|dlogits|
median and max over steps, top-1 flips and the smallest reference top-2 margin among them, how
many steps have a reference margin below that step's max|dlogits| ("at risk"), and the prefill
states' relative difference. (Until 2026-12-03 this bench was RWKV-7's only; its ``head`` and
``ffn`` variants are now the roles ``lm_head`` and ``mlp``, and ``early``/``late`` take every
quantised weight of those layers, not the FFN's only.)
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
from recurrent_coreai.stages import gate  # noqa: E402
from recurrent_coreai.stages.reference import prefill_stream  # noqa: E402


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


def selected(names, q: dict, layers: set[int] | None) -> list[str]:
    """Weight names the recipe's resolved ``q`` chooses (as quantize.plan matches linears: a tied
    one only where a raw include pattern names it), in ``layers`` (the first number in the name)."""
    out = []
    for n in names:
        linear = n.removesuffix(".weight")
        if linear == n or not quantize.matching_pattern(linear, q["include"]) \
                or quantize.matching_pattern(linear, q.get("exclude", [])):
            continue
        if linear in q.get("tied", {}) and not quantize.matching_pattern(linear, q.get("include_raw", q["include"])):
            continue
        m = re.search(r"\.(\d+)\.", n)
        if layers is not None and (m is None or int(m.group(1)) not in layers):
            continue
        out.append(n)
    return out


def run_variant(ref, stream, steps: int) -> np.ndarray:
    state, out = None, []
    for i in range(steps):
        if i == 0 or stream["pos"][i] == 0:
            state = ref.zero_state()
        out.append(ref.step(int(stream["tokens"][i]), state).numpy())
    return np.stack(out)


def prefill_states(ref, stream) -> dict:
    """The prefill check's states from ``ref`` against the stream's, judged as the gate judges them
    (stages/gate.py: max|Δ| over the reference state's max|value|), worst position per state."""
    if "prefill_tokens" not in stream:
        return {}
    tokens = stream["prefill_tokens"]
    got = prefill_stream(ref, tokens, int(stream["prefill_chunk"]), len(tokens))
    names = [k.removeprefix("prefill_state_") for k in stream if k.startswith("prefill_state_") and k != "prefill_state_pos"]
    out = {n: 0.0 for n in names}
    for i in range(len(stream["prefill_state_pos"])):
        ours = {n: got[f"prefill_state_{n}"][i] for n in names}
        theirs = {n: stream[f"prefill_state_{n}"][i] for n in names}
        rel = gate.relative_diffs(gate.state_diffs(ours, theirs), gate.state_scales(theirs))
        out = {n: max(out[n], rel[n]) for n in names}
    logits = np.abs(got["prefill_logits"] - stream["prefill_logits"]).max()
    return {"prefill_rel_dstate": out, "prefill_max_abs_dlogits": float(logits)}


def compare(logits: np.ndarray, ref_logits: np.ndarray, near_tie: float) -> dict:
    d = np.abs(logits - ref_logits).max(1)
    top2 = np.argsort(ref_logits, 1)[:, -2:]
    margin = ref_logits[np.arange(len(d)), top2[:, 1]] - ref_logits[np.arange(len(d)), top2[:, 0]]
    flips = np.flatnonzero(logits.argmax(1) != top2[:, 1])
    return {"max_abs_dlogits_median": float(np.median(d)), "max_abs_dlogits_max": float(d.max()),
            "flips": int(len(flips)), "flip_steps": flips.tolist(),
            "flips_outside_near_ties": int((margin[flips] >= near_tie).sum()),
            "flip_min_margin": float(margin[flips].min()) if len(flips) else None,
            "at_risk": int((margin < d).sum()), "steps": int(len(d)),
            "margin_p10": float(np.percentile(margin, 10)), "margin_median": float(np.median(margin))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--source", type=Path, required=True)
    ap.add_argument("--stream", type=Path, required=True)
    ap.add_argument("--family", default="rwkv7", help="the registered family of the source (default rwkv7)")
    ap.add_argument("--recipe", default="int8keepproj")
    ap.add_argument("--steps", type=int, default=None, help="default: the whole stream")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="default: none all noise early late and each of the recipe's roles")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ns = ap.parse_args()

    family = families.get(ns.family)
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    recipe, near_tie = config["recipes"][ns.recipe]["quantize"], config["gate"]["near_tie_epsilon"]
    stream = dict(np.load(ns.stream))
    steps = ns.steps or len(stream["tokens"])
    geom, weights = load_checkpoint(ns.source, family=family)
    q = quantize.resolve_roles(recipe, family.roles, ns.recipe, tied=family.tied_linears(geom))
    ref = family.reference(weights, geom, torch.float32)
    del weights
    base = dict(ref.w)
    L = geom.layers
    third = max(1, L // 3)
    groups = {"none": None, "all": (q, None), "noise": (q, None), "early": (q, set(range(third))),
              "late": (q, set(range(L - third, L)))}
    for role in recipe.get("roles", []):
        groups[role] = (quantize.resolve_roles({**recipe, "roles": [role], "include": []}, family.roles, ns.recipe,
                                               tied=family.tied_linears(geom)), None)
    variants = ns.variants or list(groups)
    unknown = [v for v in variants if v not in groups]
    if unknown:
        raise SystemExit(f"error: --variants: {unknown[0]!r} is not one of {', '.join(groups)} for recipe {ns.recipe}")
    rows = []
    gen = torch.Generator().manual_seed(ns.seed)
    for v in variants:
        names = selected(base, *groups[v]) if groups[v] else []
        t0 = time.time()
        num = den = 0.0
        ref.w = dict(base)
        for n in names:
            qw = fake_quant(base[n], recipe["bits"], recipe["block_size"])
            if v == "noise":
                qw = matched_noise(base[n], qw, recipe["block_size"], gen)
            num += float((qw - base[n]).double().pow(2).sum())
            den += float(base[n].double().pow(2).sum())
            ref.w[n] = qw
        row = {"variant": v, "weights": len(names), "rel_weight_error": (num / den) ** 0.5 if den else 0.0,
               **compare(run_variant(ref, stream, steps), stream["logits"][:steps], near_tie),
               **prefill_states(ref, stream), "seconds": round(time.time() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    ref.w = base
    if ns.json:
        ns.json.write_text(json.dumps({"source": str(ns.source), "family": ns.family, "recipe": ns.recipe,
                                       "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
