#!/usr/bin/env python3
"""Benchmark for the default model: export seconds and peak RSS per recipe, gate seconds per recipe.

    python bench/bench_export_gate.py [--model rwkv7-tiny] [--steps N]

Any model of config.yaml, any family (e.g. ``--model mamba2-tiny``). Each stage runs as its own
process (as in the pipeline); peak RSS is that process's maximum resident set (wait4 rusage).
``s/step`` is the gate process's wall seconds over the steps it compares (the gate's JSON no
longer records a time of its own: it is reproducible), so it includes the process's start and
the prefill check. Results go to stdout and bench/out/<model>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MB) of one stage process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"error: {' '.join(args[:1])} failed: {proc.stderr.read().decode()[-500:]}")
    return seconds, usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="rwkv7-tiny")
    ap.add_argument("--steps", type=int, help="gate steps (default: config.yaml's)")
    ns = ap.parse_args()
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    if ns.steps:
        cfg["gate"]["steps"] = ns.steps
    recipes = cfg["models"][ns.model]["recipes"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        conf = tmp / "config.yaml"
        conf.write_text(yaml.safe_dump(cfg))
        c = ["--config-file", str(conf), "--model", ns.model]
        src, vocab, ref = tmp / "source", tmp / "vocab.tsv", tmp / "stream.npz"
        run(["scripts/source.py", *c, "--out", str(src)])
        run(["scripts/vocab.py", *c, "--source", str(src), "--out", str(vocab)])
        ref_s, ref_rss = run(["scripts/reference.py", *c, "--source", str(src), "--vocab", str(vocab), "--out", str(ref)])
        rows = []
        for r in recipes:
            exp, low = tmp / "export" / r, tmp / "aot" / r
            exp_s, exp_rss = run(["scripts/export.py", *c, "--recipe", r, "--source", str(src), "--out", str(exp)])
            run(["scripts/aot.py", *c, "--recipe", r, "--target", "universal", "--export", str(exp), "--out", str(low)])
            gate_s, gate_rss = run(["scripts/gate.py", *c, "--recipe", r, "--export", str(exp), "--aot", str(low),
                                    "--reference", str(ref), "--json", str(tmp / f"{r}.json"), "--tsv", str(tmp / f"{r}.tsv")])
            g = json.loads((tmp / f"{r}.json").read_text())
            rows.append({"recipe": r, "export_s": round(exp_s, 1), "export_peak_rss_mb": round(exp_rss),
                         "gate_s": round(gate_s, 1), "gate_peak_rss_mb": round(gate_rss), "gate_pass": g["pass"],
                         "gate_agree": f"{g['agree_counted']}/{g['counted']}",
                         "gate_s_per_step": round(gate_s / g["steps"], 3), "bundle_mb": round(g["size_bytes"] / 1e6, 1)})
    print(f"model {ns.model}, gate {cfg['gate']['steps']} steps; reference {ref_s:.1f} s, peak RSS {ref_rss:.0f} MB")
    print(f"{'recipe':14} {'export s':>9} {'export RSS MB':>14} {'gate s':>7} {'s/step':>7} {'bundle MB':>10}  gate")
    for row in rows:
        print(f"{row['recipe']:14} {row['export_s']:9.1f} {row['export_peak_rss_mb']:14d} {row['gate_s']:7.1f} "
              f"{row['gate_s_per_step']:7.3f} {row['bundle_mb']:10.1f}  "
              f"{'PASS' if row['gate_pass'] else 'FAIL'} {row['gate_agree']}")
    out = ROOT / "bench" / "out" / f"{ns.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": ns.model, "steps": cfg["gate"]["steps"], "reference_s": round(ref_s, 1),
                               "recipes": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
