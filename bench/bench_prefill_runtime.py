#!/usr/bin/env python3
"""Prompt ingestion of a BUILT bundle in the Core AI runtime, any family: the ``main`` loop (one
token per call) against the chunked ``prefill`` function (T tokens per call) plus ``main`` for the
tail, on the same states.

    python bench/bench_prefill_runtime.py --results results --model mamba2-tiny --recipe fp32 [--tokens 512]

It reads the lowered universal bundle and its export.json from the results tree (a build of
``snakemake --cores 1 publish``), feeds ``--tokens`` token ids (a fixed pseudo-random stream)
both ways and prints tokens per CPU second of this process (the runtime computes on the calling
thread: CPU time is the work, whatever else shares the cores) and per wall second, and the
ratio prefill/main. Results also go to ``bench/out/prefill-runtime-<model>-<recipe>.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recurrent_coreai.coreai.runtime import PromptSession  # noqa: E402
from recurrent_coreai.pipeline.paths import Layout  # noqa: E402
from recurrent_coreai.pipeline.records import AOT, load_json, read_export  # noqa: E402


def timed(fn):
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    ap.add_argument("--model", required=True)
    ap.add_argument("--recipe", default="fp32")
    ap.add_argument("--tokens", type=int, default=512)
    ns = ap.parse_args()
    lay = Layout(ns.results, ns.model)
    record = read_export(lay.export(ns.recipe))
    aot_dir = lay.aot("universal", ns.recipe)
    aimodelx = aot_dir / load_json(aot_dir / AOT)["product"]
    vocab = int(record["functions"]["main"]["outputs"][0]["shape"][-1])
    tokens = np.random.default_rng(0).integers(1, min(vocab, 1000), ns.tokens).tolist()
    with PromptSession(aimodelx, record) as sess:
        chunk = sess.chunk
        sess.reset()
        via_main, main_cpu, main_wall = timed(lambda: [sess.step(t) for t in tokens][-1])
        sess.reset()
        via_prefill, pre_cpu, pre_wall = timed(lambda: sess.feed(tokens))
    row = {"model": ns.model, "recipe": ns.recipe, "tokens": ns.tokens, "chunk": chunk,
           "main_tok_per_cpu_s": round(ns.tokens / main_cpu, 1), "prefill_tok_per_cpu_s": round(ns.tokens / pre_cpu, 1),
           "speedup_cpu": round(main_cpu / pre_cpu, 2), "main_wall_s": round(main_wall, 3),
           "prefill_wall_s": round(pre_wall, 3),
           "max_abs_dlogits_prefill_vs_main": float(np.abs(via_main - via_prefill).max())}
    out = ROOT / "bench" / "out" / f"prefill-runtime-{ns.model}-{ns.recipe}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=2) + "\n")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
