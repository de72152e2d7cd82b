"""The gate's held-out text stream numbers of a built results tree, as Markdown tables.

    python bench/text_stream_table.py RESULTS [--models M ...]

Per model and recipe (every gate JSON under ``RESULTS/<model>/gate/``): the quality statistics on
the text (mean, median, p99 and max KL; same top-1; RMS Δp; perplexity of reference and bundle and
their ratio), then the long-context table (each horizon: mean KL and same top-1 of its scored
chunk, the worst state and its relative difference), and the prefill check's relative state
difference beside it. What docs/measurements/2026-12-06-text-stream.md quotes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(results: Path, models: list[str] | None):
    for gate_dir in sorted(results.glob("*/gate")):
        model = gate_dir.parent.name
        if models and model not in models:
            continue
        for path in sorted(gate_dir.glob("*.json")):
            if path.name.endswith((".doctor.json", ".failed.json")) or path.parent.name != "gate":
                continue
            verdict = json.loads(path.read_text())
            if "text" in verdict and verdict["text"]:
                yield model, path.stem, verdict


def fmt(v, spec=".3g"):
    return "—" if v is None else format(v, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--models", nargs="*")
    ns = ap.parse_args(argv)
    found = list(rows(ns.results, ns.models))
    print("| model | recipe | gate | mean KL | median KL | p99 KL | max KL | same top-1 | RMS Δp | PPL ref | "
          "PPL bundle | PPL ratio | prefill rel Δstate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, recipe, v in found:
        t = v["text"]
        print(f"| {model} | {recipe} | {'pass' if v['pass'] else 'FAIL'} | {fmt(t['kld_mean'])} | {fmt(t['kld_median'])} | "
              f"{fmt(t['kld_p99'])} | {fmt(t['kld_max'])} | {fmt(100 * t['same_top1'], '.2f')}% | {fmt(t['rms_dp'])} | "
              f"{fmt(t['ppl_ref'], '.4g')} | {fmt(t['ppl_bundle'], '.4g')} | {fmt(t['ppl_ratio'], '.5f')} | "
              f"{fmt(v['prefill']['max_rel_dstate'])} |")
    horizons = sorted({h["horizon"] for _, _, v in found for h in v["text"]["horizons"]})
    print()
    print("| model | recipe | " + " | ".join(f"{h}: KL / top-1 / rel Δstate" for h in horizons) + " | worst state |")
    print("|---|---|" + "---|" * (len(horizons) + 1))
    for model, recipe, v in found:
        by = {h["horizon"]: h for h in v["text"]["horizons"]}
        cells = [f"{fmt(by[h]['kld_mean'], '.2g')} / {fmt(100 * by[h]['same_top1'], '.1f')}% / "
                 f"{fmt(by[h]['max_rel_dstate'], '.2g')}" if h in by else "—" for h in horizons]
        worst = max(v["text"]["horizons"], key=lambda h: h["max_rel_dstate"] or 0.0)
        print(f"| {model} | {recipe} | " + " | ".join(cells) + f" | {worst['state']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
