#!/usr/bin/env python3
"""The source stage's peak RSS against the checkpoint it writes (issue 27: a 7B-class model within one
node needs the source stage to stream, holding one tensor at a time).

    python bench/bench_source_stream.py [--models rwkv6-1.6b-shape mamba2-1.3b-shape]
                                        [--layout MODEL=LAYOUT ...] [--work /tmp/source-stream] [--keep]
                                        [--json PATH]

Each model's source stage runs as the pipeline runs it (``scripts/source.py --model M --out DIR``) in
its own process; its peak RSS is that child's maximum resident set (wait4 rusage: anonymous memory
and the resident pages of files it maps), its CPU time user + system. The checkpoint is the
``model.safetensors`` the stage writes (the normal form; size and sha256 from its manifest.json).
``--layout MODEL=LAYOUT`` writes that model's synthetic source in another layout (a copy of the config
with ``source.layout`` set), e.g. ``mamba2-1.3b-shape=hf``. The outputs (several GB each) are deleted
after each model unless ``--keep``. Results go to stdout and ``--json`` (default
bench/out/source-stream.json).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GOAL = 0.2  # peak RSS / checkpoint bytes (issue 27)


def run_source(cfg_file: Path, model: str, out: Path) -> dict:
    """Wall and CPU seconds and peak RSS (bytes) of one source-stage process."""
    env = {**os.environ, "RECURRENT_COREAI_PROGRESS": "0", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "scripts/source.py", "--config-file", str(cfg_file), "--model", model,
                                 "--out", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        err.seek(0)
        last = err.read().decode(errors="replace").strip().splitlines()[-1:]
    code = os.waitstatus_to_exitcode(status)
    if code:
        sys.exit(f"error: scripts/source.py --model {model} failed ({''.join(last)}) -- fix: run it alone to see the log")
    return {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_bytes": usage.ru_maxrss * 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["rwkv6-1.6b-shape", "mamba2-1.3b-shape"])
    ap.add_argument("--layout", nargs="*", default=[], metavar="MODEL=LAYOUT",
                    help="write MODEL's synthetic source in LAYOUT (default: as config.yaml says)")
    ap.add_argument("--config-file", type=Path, default=ROOT / "config.yaml")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "source-stream")
    ap.add_argument("--keep", action="store_true", help="keep the written sources under --work")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "source-stream.json")
    ns = ap.parse_args()

    layouts = dict(item.split("=", 1) for item in ns.layout)
    cfg = yaml.safe_load(ns.config_file.read_text())
    ns.work.mkdir(parents=True, exist_ok=True)
    cfg_file = ns.config_file
    if layouts:
        for model, layout in layouts.items():
            cfg["models"][model]["source"]["layout"] = layout
        cfg_file = ns.work / "config.yaml"
        cfg_file.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rows = []
    print(f"{'model':<22} {'layout':<10} {'checkpoint MB':>13} {'peak RSS MB':>11} {'RSS/ckpt':>8} "
          f"{'wall s':>7} {'CPU s':>6}  sha256")
    for model in ns.models:
        out = ns.work / model / "source"
        shutil.rmtree(out, ignore_errors=True)
        rec = run_source(cfg_file, model, out)
        manifest = json.loads((out / "manifest.json").read_text())
        weights = manifest["files"]["model.safetensors"]
        row = {"model": model, "layout": manifest["layout"], "checkpoint_bytes": weights["size"],
               "sha256": weights["sha256"], **rec, "rss_per_checkpoint": round(rec["peak_rss_bytes"] / weights["size"], 3)}
        rows.append(row)
        print(f"{model:<22} {row['layout']:<10} {row['checkpoint_bytes'] / 2**20:>13,.0f} "
              f"{row['peak_rss_bytes'] / 2**20:>11,.0f} {row['rss_per_checkpoint']:>8.3f} {row['wall_s']:>7.1f} "
              f"{row['cpu_s']:>6.1f}  {row['sha256'][:16]}", flush=True)
        if not ns.keep:
            shutil.rmtree(ns.work / model, ignore_errors=True)
    if layouts and not ns.keep:
        cfg_file.unlink()
    ns.json.parent.mkdir(parents=True, exist_ok=True)
    ns.json.write_text(json.dumps({"goal_rss_per_checkpoint": GOAL, "rows": rows}, indent=2) + "\n")
    over = [r["model"] for r in rows if r["rss_per_checkpoint"] > GOAL]
    print(f"goal: peak RSS <= {GOAL}x the checkpoint; " + (f"over it: {', '.join(over)}" if over else "all within"))


if __name__ == "__main__":
    main()
