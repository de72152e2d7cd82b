"""The prefill check's state differences on each state's own scale (docs/gate.md: where the
``prefill_max_rel_dstate`` defaults come from): for every lowered universal bundle under
``results``, the gate's prefill check (gate.prefill_check, in the Core AI runtime) on the
reference's prefill stream; per state, the largest max|Δ| after a chunk or at the end, the
reference's max|state| there, and their ratio -- the measure the threshold bounds.

    PYTHONPATH=. python bench/prefill_dstate.py results [--config config.yaml] [model ...]

The stream is ``results/<model>/reference/stream.npz``; with ``--config``, it is made afresh from
that config's gate prompts, steps and prefill settings (with the tree's source and vocab), so a
tree built with other gate settings (the tests' shorter gate) measures the default stream.
"""
import argparse
from pathlib import Path

import yaml

from recurrent_coreai import families, tokenizers
from recurrent_coreai.coreai.runtime import PromptSession
from recurrent_coreai.pipeline import records
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.stages import gate
from recurrent_coreai.stages.reference import reference_stream

ap = argparse.ArgumentParser()
ap.add_argument("results", type=Path)
ap.add_argument("--config", type=Path, help="make the stream from this config's gate and prefill settings")
ap.add_argument("models", nargs="*")
ns = ap.parse_args()
cfg = yaml.safe_load((ns.config or ns.results.parent / "config.yaml").read_text())
models = ns.models or sorted(p.name for p in ns.results.iterdir() if (p / "aot" / "universal").is_dir())
print(f"{'model':<12} {'recipe':<14} {'state':<15} {'max|ref|':>9} {'max|d|':>10} {'max|d|/max|ref|':>16}  after")
for model in models:
    lay = Layout(ns.results, model)
    if ns.config:
        fam = families.get(cfg["models"][model]["family"])
        tok = tokenizers.kind(fam.tokenizer).load(lay.vocab)
        stream = reference_stream(fam, lay.source, tok, cfg["gate"]["prompts"], cfg["gate"]["steps"],
                                  prefill=cfg["prefill"])
    else:
        stream = records.read_stream(lay.reference)
    for aot_dir in sorted((ns.results / model / "aot" / "universal").iterdir()):
        recipe = aot_dir.name
        export = records.read_export(lay.export(recipe), files=False)
        lowering = records.read_aot(aot_dir)
        with PromptSession(aot_dir / lowering["product"], export) as sess:
            res = gate.prefill_check(sess, stream, {"min_agree": 0.0, "min_counted": 1e-9}, 0.0)
        worst: dict[str, tuple] = {}
        for row in res["rows"]:
            if row["max_rel_dstate"] is None:
                continue
            for name, rel in row["max_rel_dstate"].items():
                d = row["max_abs_dstate"][name]
                if name not in worst or not rel <= worst[name][0]:
                    worst[name] = (rel, d, d / rel if rel else float("nan"), row["pos"] + 1)
        for name, (rel, d, scale, after) in sorted(worst.items()):
            print(f"{model:<12} {recipe:<14} {name:<15} {scale:9.3g} {d:10.3g} {rel:16.3g}  {after}", flush=True)
