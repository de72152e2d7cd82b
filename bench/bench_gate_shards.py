#!/usr/bin/env python3
"""The gate as shards at scale: per-shard wall, CPU and peak RSS, and the gate's wall on 1, 2, 4,
8 and 16 nodes modelled from them.

    python bench/bench_gate_shards.py [--model rwkv7-1.5b-shape] [--recipe int8keepproj]
                                      [--work bench/out/gate-shards] [--run 0 1] [--steps 127]
                                      [--submit-s 2.0] [--json PATH]

1. Builds what a gate reads, each stage in its own process as the pipeline runs it (source,
   vocab, reference at ``--steps`` steps, export and the universal lowering of ``--recipe``),
   once into ``--work`` (kept: a rerun reuses it).
2. Counts the shards as Snakemake does (``resources.gate_shards``) and runs the shards of
   ``--run`` (default: all) one after another with ``scripts/gate_shard.py``, one process each:
   wall, CPU (user + system) and peak RSS of the child (wait4 rusage).
3. With every shard run, gathers them with ``scripts/gate.py --shards`` (the verdict: steps,
   top-1, max|dlogits|).
4. The model: a shard not run gets its cost (decode calls, warm-up included; pipeline/shards.py)
   times the seconds per decode call of the measured shards that hold decode steps only. N nodes run the shards
   longest first, one shard per node at a time (LPT list scheduling); each shard job pays
   ``--submit-s`` (SLURM's submit-to-start latency; measure it with ``make test-cluster``'s sacct
   times) and the gather runs after the last one. A shard's cost on a node of its own is its CPU
   seconds by default (``--basis``): one runtime call computes on one thread, and on a busy
   machine the wall counts the other work too. The table is printed and written to ``--json``.
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

from bench_scale import run as run_stage  # noqa: E402
from recurrent_coreai.pipeline import resources, shards  # noqa: E402
from recurrent_coreai.stages import gate  # noqa: E402

NODES = (1, 2, 4, 8, 16)


def run(args: list[str], what: str) -> dict:
    """Wall, CPU and peak RSS of one stage process (bench_scale.run); exits on a failure."""
    wall, rss_mb, _, cpu, _ = run_stage(args, what)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "peak_rss_mb": round(rss_mb)}


def build(work: Path, conf: Path, model: str, recipe: str) -> dict:
    """source, vocab, reference, export and aot into ``work`` (each only if missing); their costs."""
    c = ["--config-file", str(conf), "--model", model]
    steps = {}
    plan = [("source", work / "source", ["scripts/source.py", *c, "--out", str(work / "source")]),
            ("vocab", work / "vocab", ["scripts/vocab.py", *c, "--source", str(work / "source"), "--out", str(work / "vocab")]),
            ("reference", work / "stream.npz", ["scripts/reference.py", *c, "--source", str(work / "source"),
                                               "--vocab", str(work / "vocab"), "--out", str(work / "stream.npz")]),
            ("export", work / "export", ["scripts/export.py", *c, "--recipe", recipe, "--source", str(work / "source"),
                                         "--out", str(work / "export")]),
            ("aot", work / "aot", ["scripts/aot.py", *c, "--recipe", recipe, "--target", "universal",
                                   "--export", str(work / "export"), "--out", str(work / "aot")])]
    for name, out, args in plan:
        if not out.exists():
            steps[name] = run(args, name)
            print(f"{name}: {steps[name]}", flush=True)
    return steps


def lpt(walls: list[float], nodes: int, submit_s: float) -> float:
    """Makespan of the shards on ``nodes`` nodes, longest first, each paying ``submit_s``."""
    free = [0.0] * nodes
    for w in sorted(walls, reverse=True):
        heapq.heappush(free, heapq.heappop(free) + submit_s + w)
    return max(free)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="rwkv7-1.5b-shape")
    ap.add_argument("--recipe", default="int8keepproj")
    ap.add_argument("--config-file", type=Path, default=ROOT / "config.yaml")
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "gate-shards")
    ap.add_argument("--steps", type=int, default=127, help="gate steps (the model's own steps setting is dropped)")
    ap.add_argument("--run", type=int, nargs="*", help="the shards to run (default: all)")
    ap.add_argument("--submit-s", type=float, default=2.0, help="scheduling overhead per shard job, seconds")
    ap.add_argument("--basis", choices=("cpu", "wall"), default="cpu",
                    help="what a shard costs on a node of its own: its CPU seconds (default: the runtime computes a "
                         "call on one thread, so on a busy machine wall time counts the other work too) or its wall")
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    work = (ns.work / f"{ns.model}-{ns.recipe}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load(ns.config_file.read_text())
    cfg["gate"]["steps"] = ns.steps
    own = cfg["models"][ns.model].get("gate", {})
    own.get("steps", {}).pop(ns.recipe, None)  # all the steps: the bench measures the full gate
    if own and not own.get("steps"):
        own.pop("steps", None)
        if "thresholds" not in own:
            cfg["models"][ns.model].pop("gate")
    cfg["models"][ns.model]["enabled"] = True
    conf = work / "config.yaml"
    conf.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    built = build(work, conf, ns.model, ns.recipe)
    count = resources.gate_shards(cfg, ns.model, ns.recipe)
    import numpy as np

    with np.load(work / "stream.npz") as npz:
        stream = {k: npz[k] for k in ("prompt", "prefill_tokens", "prefill_chunk")}
    from recurrent_coreai.pipeline.config import gate_settings, prompt_budgets, settings

    g = gate_settings(settings(cfg, "gate", model=ns.model, recipe=ns.recipe), ns.recipe)
    keep = [i for p in range(len(g["prompts"])) for i in np.flatnonzero(stream["prompt"] == p)[
        :prompt_budgets([0] * len(g["prompts"]), g["steps"])[p]]]  # the gated steps (equal shares)
    stream["prompt"] = stream["prompt"][keep]
    plan = gate.shard_plan(stream, count)
    chunk, tokens = int(stream["prefill_chunk"]), len(stream["prefill_tokens"])
    costs = [sum(shards.piece_cost(p, chunk, tokens) for p in s) for s in plan]
    print(f"{ns.model}/{ns.recipe}: {count} shard(s), costs in decode calls {[round(c, 1) for c in costs]}", flush=True)
    c = ["--config-file", str(conf), "--model", ns.model, "--recipe", ns.recipe, "--export", str(work / "export"),
         "--aot", str(work / "aot"), "--reference", str(work / "stream.npz")]
    measured = {}
    for k in (range(count) if ns.run is None else ns.run):
        out = work / "shards" / f"shard-{k}.json"
        if out.is_file() and (work / "shards" / f"shard-{k}.cost.json").is_file():
            measured[k] = json.loads((work / "shards" / f"shard-{k}.cost.json").read_text())
        else:
            env_threads = os.environ.get("OMP_NUM_THREADS")
            os.environ["OMP_NUM_THREADS"] = "1"  # one process per shard, as a multi-shard gate asks
            measured[k] = run(["scripts/gate_shard.py", *c, "--shard", str(k), "--shards", str(count), "--out", str(out),
                               "--log", str(work / "shards" / f"shard-{k}.log")], f"shard {k}")
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads
            (work / "shards" / f"shard-{k}.cost.json").write_text(json.dumps(measured[k]) + "\n")
        measured[k]["cost_calls"] = round(costs[k], 1)
        print(f"shard {k}: {measured[k]}", flush=True)
    # a shard not run: seconds per decode call from the measured shards of decode steps only (the
    # prefill check's calls cost another amount: a 64-token prefill call of an int8 bundle is mostly
    # the same dequantisation as a decode call), times its decode calls; startup is inside that rate
    decode_only = [k for k in measured if not any(p.get(shards.PREFILL) for p in plan[k])] or list(measured)
    rate = sum(measured[k][f"{ns.basis}_s"] for k in decode_only) / sum(costs[k] for k in decode_only)
    startup = 0.0
    walls = [measured[k][f"{ns.basis}_s"] if k in measured else startup + rate * costs[k] for k in range(count)]
    verdict = None
    gather_s = 5.0
    if len(measured) == count:
        paths = [str(work / "shards" / f"shard-{k}.json") for k in range(count)]
        got = run(["scripts/gate.py", *c, "--shards", *paths, "--json", str(work / "gate.json"),
                   "--tsv", str(work / "gate.tsv")], "gather") if not (work / "gate.json").is_file() else {}
        gather_s = got.get("wall_s", gather_s)
        v = json.loads((work / "gate.json").read_text())
        verdict = {k: v[k] for k in ("pass", "steps", "counted", "agree_counted", "near_ties", "max_abs_dlogits")}
        verdict["prefill_max_rel_dstate"] = v["prefill"]["max_rel_dstate"]
    table = {n: round(lpt(walls, n, ns.submit_s) + gather_s, 1) for n in NODES}
    print(f"seconds per decode call {rate:.1f}, startup {startup:.1f} s; shard walls {[round(w) for w in walls]}")
    for n, w in table.items():
        print(f"{n:3d} node(s): {w / 60:6.1f} min")
    result = {"model": ns.model, "recipe": ns.recipe, "steps": ns.steps, "shards": count, "costs_calls": costs,
              "built": built, "measured": measured, "seconds_per_call": round(float(rate), 2),
              "startup_s": round(float(startup), 1), "shard_walls_s": [round(w, 1) for w in walls],
              "submit_s": ns.submit_s, "basis": ns.basis, "gather_s": gather_s, "nodes_wall_s": table, "verdict": verdict,
              "cores": os.cpu_count()}
    out = ns.json or ROOT / "bench" / "out" / f"gate-shards-{ns.model}-{ns.recipe}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
