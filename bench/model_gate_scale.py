#!/usr/bin/env python3
"""The gate of a model too large to gate here (the 7B-class entries), modelled from a measured one.

    python bench/model_gate_scale.py --measured bench/out/gate-shards-rwkv6-1.6b-shape-fp16.json \
        --model rwkv6-7b-shape [--recipe fp16] [--submit-s 2.0] [--shard-seconds S] [--json PATH]

``--measured`` is what ``bench/bench_gate_shards.py`` wrote for a smaller model of the same family
and recipe (every shard run). The model:

1. the shard plan of ``--model`` as Snakemake cuts it (``resources.gate_shards`` on config.yaml,
   the plan of ``pipeline/shards.py``; costs in decode calls, warm-up included);
2. a shard's seconds = its decode calls x the measured seconds per decode call (CPU, the
   decode-only shards: startup, and for a quantised bundle the fold and its check, spread over
   the calls) x the ratio of parameter counts. One decode call reads every weight once, so its
   cost grows with the parameter count; the fold and its check do too (one pass over the weights).
   This is an assumption, not a measurement: state sizes and the vocabulary do not scale alike;
3. N nodes run the shards longest first (LPT), each paying ``--submit-s``, and the gather (its
   measured wall) runs after the last one.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_gate_shards import NODES, lpt  # noqa: E402
from recurrent_coreai.pipeline import resources, shards  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", type=Path, required=True, help="bench_gate_shards.py's JSON, every shard run")
    ap.add_argument("--model", required=True, help="the model to model (config.yaml; enabled or not)")
    ap.add_argument("--recipe", help="default: the measured recipe")
    ap.add_argument("--config-file", type=Path, default=ROOT / "config.yaml")
    ap.add_argument("--submit-s", type=float, default=2.0)
    ap.add_argument("--shard-seconds", type=float, help="config.yaml's gate.shard_seconds for the plan (default: as configured)")
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    measured = json.loads(ns.measured.read_text())
    if len(measured["measured"]) != measured["shards"]:
        sys.exit(f"error: {ns.measured}: {len(measured['measured'])} of {measured['shards']} shards measured -- "
                 "fix: run every shard with bench/bench_gate_shards.py first")
    recipe = ns.recipe or measured["recipe"]
    cfg = yaml.safe_load(ns.config_file.read_text())
    if ns.shard_seconds:
        cfg["gate"]["shard_seconds"] = ns.shard_seconds
    big, small = (resources.configured_parameters(cfg["models"][m]) for m in (ns.model, measured["model"]))
    ratio = big / small
    count = resources.gate_shards(cfg, ns.model, recipe)
    lengths, tokens, chunk, text = resources.gate_plan_shape(cfg, ns.model, recipe)
    plan = shards.plan(lengths, tokens, chunk, count, text)
    costs = [sum(shards.piece_cost(p, chunk, tokens, text) for p in s) for s in plan]
    walls = [measured["seconds_per_call"] * ratio * c for c in costs]
    table = {n: round(lpt(walls, n, ns.submit_s) + measured["gather_s"], 1) for n in NODES}
    print(f"{ns.model}/{recipe}: {big:,} parameters, {ratio:.2f}x {measured['model']}'s; {count} shard(s) of "
          f"{[round(c, 1) for c in costs]} decode calls at {measured['seconds_per_call'] * ratio:.1f} s each "
          f"({measured['seconds_per_call']} s measured)")
    for n, w in table.items():
        print(f"{n:3d} node(s): {w / 60:6.1f} min")
    out = ns.json or ROOT / "bench" / "out" / f"gate-model-{ns.model}-{recipe}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": ns.model, "recipe": recipe, "parameters": big, "from": measured["model"],
                               "ratio": ratio, "shards": count, "shard_seconds_target": cfg["gate"].get("shard_seconds"), "costs_calls": costs,
                               "seconds_per_call": measured["seconds_per_call"] * ratio,
                               "shard_seconds": [round(w, 1) for w in walls], "submit_s": ns.submit_s,
                               "nodes_wall_s": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
