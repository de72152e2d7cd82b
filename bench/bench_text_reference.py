#!/usr/bin/env python3
"""The reference stage's text stream at a large shape: token by token against the chunked fp32
form (stages/text_chunked.py), from measured per-call rates.

    python bench/bench_text_reference.py --model rwkv7-1.5b-shape [--tokens 320] [--json PATH]

Synthetic weights of the config entry's shape (its seed), in memory. Measured on a short run of
``--tokens`` tokens of the held-out text's bytes (ids < 256 are valid in every vocabulary; the
cost does not depend on the ids), one horizon at 128 (so: a prefill chunk, a chunk through decode,
then prefill chunks to the end):

* token by token: the reference's steps over the first horizon (:func:`stages.reference.text_stream`,
  the head only where scored) -- the chunked form's check; then 4 steps timed apart, ``advance``
  (every layer) and ``logits`` (the head);
* chunked: :func:`text_chunked.chunked_text_stream` over the short run (its prefill and decode
  calls timed one by one), then :func:`text_chunked.compare` with the steps (the check's numbers).

Then the cost of the configured stream (gate.text: 2048 tokens, horizons 128/512/1024/2048) both
ways = the plan's calls (coreai/entrypoints.text_plan) x the measured seconds per call: token by
token, ``tokens`` advances and ``scored`` heads; chunked, the plan's prefill and decode
calls plus the check's steps. Wall seconds, one process; set OMP_NUM_THREADS to the cores a
reference job gets.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recurrent_coreai import families  # noqa: E402
from recurrent_coreai.coreai.entrypoints import DECODE, text_logit_positions, text_plan  # noqa: E402
from recurrent_coreai.stages import reference, text_chunked  # noqa: E402


class Timed:
    """A module whose calls are timed (seconds per call, by kind)."""

    def __init__(self, module, log: list):
        self.module, self.log = module, log

    def __getattr__(self, name):
        return getattr(self.module, name)

    def eval(self):
        self.module.eval()
        return self

    def __call__(self, ids, pos):
        t = time.perf_counter()
        out = self.module(ids, pos)
        self.log.append((ids.shape[1], time.perf_counter() - t))
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", type=Path, default=ROOT / "config.yaml")
    ap.add_argument("--tokens", type=int, default=320, help="tokens of the short measured run (a multiple of chunk)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    cfg = yaml.safe_load(args.config.read_text())
    entry = cfg["models"][args.model]
    fam = families.get(entry["family"])
    chunk, text = int(cfg["prefill"]["chunk"]), cfg["gate"]["text"]
    geom = fam.geometry_from_shape(entry["source"]["shape"], args.model)
    t = time.perf_counter()
    weights = dict(fam.synthetic_tensors(geom, int(entry["source"]["seed"])))
    synth_s = time.perf_counter() - t
    params = fam.parameter_count(geom)
    print(f"{args.model}: {params:,} parameters, synthetic weights in {synth_s:.0f} s", flush=True)
    toks = np.frombuffer((ROOT / text["file"]).read_bytes()[: args.tokens], np.uint8).astype(np.int64)
    horizons = [128]

    ref = fam.reference(weights, geom, torch.float32)
    t = time.perf_counter()
    steps = reference.text_stream(ref, toks[:128], chunk, [128])
    steps_s = time.perf_counter() - t
    scored_128 = len(steps["text_logit_pos"])
    print(f"token by token, 128 tokens ({scored_128} scored): {steps_s:.1f} s", flush=True)
    state, adv, head = ref.zero_state(), [], []
    for tok in toks[:4]:
        t = time.perf_counter()
        x = ref.advance(int(tok), state)
        adv.append(time.perf_counter() - t)
        t = time.perf_counter()
        ref.logits(x)
        head.append(time.perf_counter() - t)
    adv_s, head_s = float(np.median(adv)), float(np.median(head))

    calls: list = []
    fam_t = type("TimedFamily", (), {
        "build_decode": staticmethod(lambda *a, **k: Timed(fam.build_decode(*a, **k), calls)),
        "build_prefill": staticmethod(lambda dec, c: Timed(fam.build_prefill(dec.module, c).eval(), calls)),
        "state_specs": staticmethod(fam.state_specs)})
    t = time.perf_counter()
    ch = text_chunked.chunked_text_stream(fam_t, weights, geom, toks, chunk, horizons)
    chunked_s = time.perf_counter() - t
    dl, rel = text_chunked.compare(ch, steps)
    pre = [s for n, s in calls if n == chunk]
    dec = [s for n, s in calls if n == 1]
    print(f"chunked, {args.tokens} tokens: {chunked_s:.1f} s ({len(pre)} prefill calls, {len(dec)} decode calls); "
          f"vs token by token over 128: max|dlogits| {dl:.3g}, worst state {rel:.3g}", flush=True)

    # the configured stream, both ways, from the measured rates
    n, hz = int(text["tokens"]), [int(h) for h in text["horizons"]]
    plan = text_plan(n, chunk, hz)
    n_pre = sum(1 for fn, _, _ in plan if fn != DECODE)
    n_dec = sum(b - a for fn, a, b in plan if fn == DECODE)
    scored = len(text_logit_positions(n, chunk, hz))
    pre_s, dec_s = float(np.median(pre)), float(np.median(dec))
    est_steps = n * adv_s + scored * head_s                                   # the head only where scored
    est_chunked = n_pre * pre_s + n_dec * dec_s + hz[0] * adv_s + scored_128 * head_s
    out = {"model": args.model, "parameters": params, "threads": torch.get_num_threads(), "chunk": chunk,
           "measured": {"steps_128_s": round(steps_s, 2), "scored_in_128": scored_128,
                        "chunked_tokens": args.tokens, "chunked_s": round(chunked_s, 2),
                        "prefill_call_s": round(pre_s, 3), "decode_call_s": round(dec_s, 3),
                        "advance_s": round(adv_s, 3), "head_s": round(head_s, 3), "check_max_dlogits": dl, "check_max_rel_dstate": rel},
           "stream": {"tokens": n, "horizons": hz, "prefill_calls": n_pre, "decode_calls": n_dec, "scored": scored},
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
           "estimate_s": {"token_by_token": round(est_steps, 1), "chunked_with_check": round(est_chunked, 1)}}
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
