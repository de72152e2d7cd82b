#!/usr/bin/env python3
"""Where the export's wall time goes, phase by phase, for a synthetic model of any depth and width.

    python bench/bench_export_phases.py [--layers 24] [--hidden 256] [--recipe fp16] [--chunk 64]

RWKV-7 only (the geometry is RWKV-7's, FFN 4 x hidden, LoRA 64/64/32/128, vocab 65536). Per
entry point (``main``, ``prefill``): ``torch.export.export`` and coreai-torch's
``run_decompositions``, with the graph's node count before and after; then the one conversion of
both functions to a ``.aimodel`` (``coreai.convert.save_functions``, into a temporary directory). Tracing
grows with the number of layers and hardly with the width, so a narrow model of the real depth
shows the 1.5B's tracing time in a fraction of its memory. Process CPU is one core at a time:
run it on an idle machine.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_linear  # noqa: E402
from recurrent_coreai.coreai.convert import Traced, save_functions, state_writes  # noqa: E402
from recurrent_coreai.coreai.entrypoints import ENTRY_POINTS  # noqa: E402
from recurrent_coreai.families.rwkv7.geometry import Geometry  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--recipe", default="fp16")
    ap.add_argument("--chunk", type=int, default=64)
    ns = ap.parse_args()
    import coreai_torch

    g = Geometry(layers=ns.layers, hidden=ns.hidden, head_dim=64, ffn=4 * ns.hidden, vocab=65536,
                 decay_lora=64, a_lora=64, v_lora=32, gate_lora=128)
    recipe = yaml.safe_load((ROOT / "config.yaml").read_text())["recipes"][ns.recipe]
    module, _ = bench_linear.build(bench_linear.synthetic_sd(g), g, recipe, ns.recipe)
    states = bench_linear.states(g)
    traced, total = [], 0.0
    for entry in ENTRY_POINTS:
        t0 = time.perf_counter()
        ep = torch.export.export(entry.module(bench_linear.FAMILY, module, ns.chunk), entry.example_inputs(ns.chunk))
        t1 = time.perf_counter()
        lowered = ep.run_decompositions(coreai_torch.get_decomp_table())
        t2 = time.perf_counter()
        total += t2 - t0
        print(f"{entry.name:8s} torch.export {t1 - t0:6.1f} s  decompositions {t2 - t1:6.1f} s  "
              f"nodes {len(ep.graph.nodes)} -> {len(lowered.graph.nodes)}  writes {state_writes(ep, states)}",
              flush=True)
        traced.append(Traced(entry, lowered, {}, states))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        save_functions(traced, Path(tmp) / "bench.aimodel")
        save = time.perf_counter() - t0
    print(f"tracing {total:.1f} s; conversion + save {save:.1f} s "
          f"({ns.layers} x {ns.hidden}, {ns.recipe}, chunk {ns.chunk})")


if __name__ == "__main__":
    main()
