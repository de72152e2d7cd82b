#!/usr/bin/env python3
"""Export and AOT at scale (default: the 1.5B geometry with synthetic weights): time, peak RSS, size.

Any family: ``--model`` is any model of config.yaml (e.g. rwkv6-1.6b-shape, mamba2-1.3b-shape,
or rwkv7-tiny for a smoke run); ``ideal`` comes from the family's parameter count.

    python bench/bench_scale.py [--model rwkv7-1.5b-shape] [--recipes fp16 int8keepproj]
                                [--cache bench/out/cache] [--gate-steps N] [--fresh-source | --source-only]
                                [--json PATH]

The checkpoint is synthesised once (scripts/source.py) into ``--cache``/<model>/source and reused;
the source stage's seconds and peak RSS are reported when it ran (``--fresh-source`` reruns it,
``--source-only`` reruns it and stops there).
Then per recipe, each stage in its own process as in the pipeline: export (scripts/export.py) and
the universal AOT lowering (scripts/aot.py); with ``--gate-steps N`` also vocab + reference once
and the gate (scripts/gate.py) for N steps. Peak RSS is the child's maximum resident set (wait4
rusage). ``ideal`` is the bundle's weights at the recipe's precision: 2 B (fp16) or 4 B (fp32)
per weight, and for each quantised linear bits/8 B per weight plus one fp16 scale per block
(export.json's ``quantized`` list); the ratio shows what the format adds. Results go to stdout
and ``--json`` (default bench/out/scale-<model>.json, or scale-<model>-source.json with
``--source-only``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recurrent_coreai import families  # noqa: E402

BYTES = {"float16": 2, "float32": 4}
SCALE_BYTES = 2  # one fp16 scale per block of a quantised weight


def run(args: list[str], what: str, check: bool = True) -> tuple[float, float, int, float, str]:
    """(wall seconds, peak RSS MB, exit code, CPU seconds: user + system, last stderr line) of one
    stage process."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: a long stderr must not block the child
        proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        err.seek(0)
        last = err.read().decode(errors="replace").strip().splitlines()[-1:]
    seconds, code = time.perf_counter() - t0, os.waitstatus_to_exitcode(status)
    if code and check:
        sys.exit(f"error: {args[0]}: {what} failed ({last}) -- fix: run it alone to see the full log")
    return seconds, usage.ru_maxrss / 1024, code, usage.ru_utime + usage.ru_stime, "".join(last)


def ideal_bytes(family, record: dict) -> int:
    """The weights of an export.json's bundle at its recipe's precision (see the module doc)."""
    total = family.parameter_count(family.geometry_from_dict(record["geometry"]))
    per = BYTES[record["recipe_spec"]["dtype"]]
    q = record["recipe_spec"].get("quantize") or {}
    quantised = 0.0
    for row in record["quantized"]:
        n = math.prod(row["shape"])
        total -= n
        quantised += n * q["bits"] / 8 + n / q["block_size"] * SCALE_BYTES
    return round(total * per + quantised)


def source(cfg_file: Path, model: str, cache: Path, fresh: bool = False) -> tuple[Path, dict]:
    """The source stage's output dir and its record: seconds, peak RSS, checkpoint size (or cached)."""
    src = cache / model / "source"
    if (src / "manifest.json").is_file() and not fresh:
        return src, {"cached": True}
    s, rss, _, cpu, _ = run(["scripts/source.py", "--config-file", str(cfg_file), "--model", model, "--out", str(src)],
                         "source")
    weights = json.loads((src / "manifest.json").read_text())["files"]["model.safetensors"]
    return src, {"cached": False, "seconds": round(s, 1), "cpu_seconds": round(cpu, 1), "peak_rss_mb": round(rss),
                 "checkpoint_bytes": weights["size"], "rss_over_checkpoint": round(rss * 2**20 / weights["size"], 3),
                 "checkpoint_sha256": weights["sha256"]}


def describe_source(rec: dict) -> str:
    if rec["cached"]:
        return "source cached (not measured; --fresh-source reruns it)"
    return (f"source {rec['seconds']:.0f} s ({rec['cpu_seconds']:.0f} s CPU), peak RSS {rec['peak_rss_mb']} MB = "
            f"{rec['rss_over_checkpoint']:.2f} x the {rec['checkpoint_bytes'] / 1e6:.0f} MB checkpoint")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="rwkv7-1.5b-shape")
    ap.add_argument("--recipes", nargs="+", help="default: the model's recipes in config.yaml")
    ap.add_argument("--config-file", type=Path, default=ROOT / "config.yaml")
    ap.add_argument("--cache", type=Path, default=ROOT / "bench" / "out" / "cache", help="synthesised checkpoints")
    ap.add_argument("--gate-steps", type=int, help="also run the gate for N steps (slow at 1.5B: ~1 min/step fp16)")
    ap.add_argument("--fresh-source", action="store_true", help="rerun (and measure) the source stage even if cached")
    ap.add_argument("--source-only", action="store_true", help="rerun and measure the source stage only")
    ap.add_argument("--json", type=Path, help="where the results go (default: bench/out/scale-<model>[-source].json)")
    ns = ap.parse_args()
    cfg = yaml.safe_load(ns.config_file.read_text())
    if ns.model not in cfg["models"]:
        sys.exit(f"error: {ns.config_file}: no model {ns.model!r} -- fix: use one of {sorted(cfg['models'])}")
    recipes = ns.recipes or cfg["models"][ns.model]["recipes"]
    family = families.get(cfg["models"][ns.model]["family"], ns.config_file)
    cache = ns.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    src, made = source(ns.config_file, ns.model, cache, fresh=ns.fresh_source or ns.source_only)
    out = ns.json or ROOT / "bench" / "out" / f"scale-{ns.model}{'-source' if ns.source_only else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if ns.source_only:
        print(f"model {ns.model}, {describe_source(made)}; {os.cpu_count()} cores")
        out.write_text(json.dumps({"model": ns.model, "cores": os.cpu_count(), "source": made}, indent=2) + "\n")
        return
    rows, ref_s = [], None
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        tmp = Path(tmp)
        if ns.gate_steps:
            cfg["gate"]["steps"] = ns.gate_steps
        conf = tmp / "config.yaml"
        conf.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
        c = ["--config-file", str(conf), "--model", ns.model]
        ref = tmp / "stream.npz"
        if ns.gate_steps:
            run(["scripts/vocab.py", *c, "--source", str(src), "--out", str(tmp / "vocab.tsv")], "vocab")
            ref_s, _, _, _, _ = run(["scripts/reference.py", *c, "--source", str(src), "--vocab", str(tmp / "vocab.tsv"),
                                  "--out", str(ref)], "reference")
        for r in recipes:
            exp, low = tmp / "export" / r, tmp / "aot" / r
            exp_s, exp_rss, _, _, _ = run(["scripts/export.py", *c, "--recipe", r, "--source", str(src),
                                        "--out", str(exp)], f"export {r}")
            record = json.loads((exp / "export.json").read_text())
            aot_s, aot_rss, aot_code, _, aot_last = run(["scripts/aot.py", *c, "--recipe", r, "--target", "universal",
                                                         "--export", str(exp), "--out", str(low)], f"aot {r}",
                                                        check=False)  # the export's numbers still count
            row = {"recipe": r, "export_s": round(exp_s, 1), "export_peak_rss_mb": round(exp_rss),
                   "bundle_bytes": record["size_bytes"], "ideal_bytes": ideal_bytes(family, record),
                   "rss_over_bundle": round(exp_rss * 2**20 / record["size_bytes"], 2),
                   "aot_s": round(aot_s, 1), "aot_peak_rss_mb": round(aot_rss),
                   "mlirb_sha256": record["files"]["main.mlirb"]["sha256"]}
            row["bundle_over_ideal"] = round(row["bundle_bytes"] / row["ideal_bytes"], 4)
            if aot_code:
                row["aot_error"] = f"exit {aot_code}: {aot_last}"
                print(f"{r}: the AOT lowering failed ({row['aot_error']}); no gate for it", file=sys.stderr)
            elif ns.gate_steps:
                gate_s, _, code, _, _ = run(["scripts/gate.py", *c, "--recipe", r, "--export", str(exp), "--aot", str(low),
                                          "--reference", str(ref), "--json", str(tmp / f"{r}.json"),
                                          "--tsv", str(tmp / f"{r}.tsv")], f"gate {r}", check=False)
                verdict = next((p for p in (tmp / f"{r}.json", tmp / f"{r}.failed.json") if p.is_file()), None)
                g = json.loads(verdict.read_text()) if verdict else {}  # a failing gate writes <r>.failed.json
                row.update(gate_s=round(gate_s, 1), gate_s_per_step=round(gate_s / ns.gate_steps, 2), gate_exit=code,
                           gate_pass=g.get("pass"), gate_agree=f"{g.get('agree_counted')}/{g.get('counted')}",
                           gate_max_abs_dlogits=g.get("max_abs_dlogits"),
                           gate_workers=int(os.environ.get("OMP_NUM_THREADS") or 1))
            rows.append(row)
            for d in (exp, low):  # a 1.5B bundle is GBs: keep one recipe on disk at a time
                subprocess.run(["rm", "-rf", str(d)], check=True)
    print(f"model {ns.model}, {describe_source(made)}; {os.cpu_count()} cores"
          + (f"; gate {ns.gate_steps} steps, reference {ref_s:.0f} s" if ns.gate_steps else ""))
    print(f"{'recipe':14} {'export s':>9} {'peak RSS MB':>12} {'bundle MB':>10} {'RSS/bundle':>11} "
          f"{'ideal MB':>9} {'/ideal':>7} {'AOT s':>7} {'AOT RSS MB':>11}" + (" gate s  s/step" if ns.gate_steps else ""))
    for x in rows:
        print(f"{x['recipe']:14} {x['export_s']:9.1f} {x['export_peak_rss_mb']:12d} {x['bundle_bytes'] / 1e6:10.1f} "
              f"{x['rss_over_bundle']:11.2f} {x['ideal_bytes'] / 1e6:9.1f} {x['bundle_over_ideal']:7.4f} "
              f"{x['aot_s']:7.1f} {x['aot_peak_rss_mb']:11d}"
              + (f" {x['gate_s']:6.1f} {x['gate_s_per_step'] or float('nan'):7.2f}" if "gate_s" in x else "")
              + (f"  AOT FAILED ({x['aot_error']})" if "aot_error" in x else ""))
    out.write_text(json.dumps({"model": ns.model, "cores": os.cpu_count(), "gate_steps": ns.gate_steps,
                               "source": made, "recipes": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
