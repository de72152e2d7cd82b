"""What a linear layer costs the Linux Core AI runtime, by how the bundle holds it, and what the
gate's constant fold (recurrent_coreai/coreai/constant_fold.py) gains on a built tree.

    python bench/bench_runtime_linear.py [--results results] [--models rwkv7-tiny,rwkv6-tiny] [--recipes fp32,fp16,int8keepproj]

Part 1 (no tree needed): a 65536 x 128 head (a World-vocabulary tiny model's) exported three ways
-- ``nn.Linear`` (torch's permute + mm), ``x @ Wt`` with the weight stored transposed, ``W @ x``
(how the pipeline's fp32 bundles hold a linear after coreai-torch's conversion) -- in fp32 and
fp16, lowered for ``universal`` and called 20 times: ms per call.

Part 2 (a built tree): for each model and recipe, the gate's fold of the shipped bundle (what it
folded, its seconds), whether its first calls are bit-identical to the aot stage's lowering
(stages/gate_lowering.first_difference), and ms per ``main`` call on both lowerings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

import recurrent_coreai  # noqa: F401 - first: the deterministic-hashing environment, numpy's kernels

V, C, CALLS = 65536, 128, 20


def layouts() -> list[dict]:
    import torch
    import coreai.runtime as rt
    import coreai_torch
    from coreai.authoring.asset import AIModelAsset

    from recurrent_coreai.coreai.runtime import lower_universal

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e, self.h = torch.nn.Embedding(256, C), torch.nn.Linear(C, V, bias=False)

        def forward(self, ids):
            return self.h(self.e(ids))

    class StoredTransposed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e, self.w = torch.nn.Embedding(256, C), torch.nn.Parameter(torch.randn(C, V) * 0.05)

        def forward(self, ids):
            return self.e(ids) @ self.w

    class WeightTimesColumn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e, self.w = torch.nn.Embedding(256, C), torch.nn.Parameter(torch.randn(V, C) * 0.05)

        def forward(self, ids):
            return torch.matmul(self.w, self.e(ids).reshape(C, 1)).reshape(1, 1, V)

    rows = []
    for name, cls in (("nn.Linear (permute + mm)", Linear), ("x @ Wt (stored transposed)", StoredTransposed),
                      ("W @ x (the fp32 bundles' form)", WeightTimesColumn)):
        for dtype in (torch.float32, torch.float16):
            torch.manual_seed(0)
            m = cls().to(dtype).eval()
            ep = torch.export.export(m, (torch.zeros(1, 1, dtype=torch.int32),))
            ep = ep.run_decompositions(coreai_torch.get_decomp_table())
            conv = coreai_torch.TorchConverter(mode=coreai_torch.TorchConverter.Mode.RELEASE)
            conv.add_exported_program(ep, input_names=["ids"], output_names=["out"], state_names=[],
                                      entrypoint_name="main")
            with tempfile.TemporaryDirectory() as tmp:
                aimodel, lowered = Path(tmp) / "x.aimodel", Path(tmp) / "x.aimodelx"
                conv.to_coreai().save_asset(aimodel)
                lowered.mkdir()
                lower_universal(aimodel, lowered)
                assert AIModelAsset.is_valid(aimodel)

                async def timed():
                    model = await rt.AIModel.load(str(lowered))
                    fn = model.load_function("main")
                    ids = rt.NDArray(np.zeros((1, 1), np.int32))
                    await fn(inputs={"ids": ids}, state={})
                    t = time.perf_counter()
                    for _ in range(CALLS):
                        await fn(inputs={"ids": ids}, state={})
                    return (time.perf_counter() - t) / CALLS * 1000
                ms = asyncio.run(timed())
            rows.append({"form": name, "dtype": str(dtype).removeprefix("torch."), "ms_per_call": round(ms, 1)})
            print(f"{name:32s} {rows[-1]['dtype']:8s} {ms:7.1f} ms/call", flush=True)
    return rows


def folds(results: Path, models: list[str], recipes: list[str]) -> list[dict]:
    from recurrent_coreai.coreai.constant_fold import NothingToFold, fold_constants
    from recurrent_coreai.coreai.runtime import PromptSession
    from recurrent_coreai.pipeline.records import read_export
    from recurrent_coreai.stages.gate_lowering import first_difference

    rows = []
    for model in models:
        for recipe in recipes:
            export = results / model / "export" / recipe
            if not (export / "export.json").is_file():
                continue
            record = read_export(export, files=False)
            shipped = next((results / model / "aot" / "universal" / recipe).glob("*.aimodelx"))
            with tempfile.TemporaryDirectory(dir=results) as tmp:
                folded = Path(tmp) / shipped.name
                folded.mkdir()
                t = time.perf_counter()
                try:
                    info = fold_constants(export / record["bundle"], folded)
                except NothingToFold:
                    rows.append({"model": model, "recipe": recipe, "folded": None})
                    print(f"{model}/{recipe}: nothing to fold", flush=True)
                    continue
                seconds = time.perf_counter() - t
                tokens = [int(x) for x in np.random.default_rng(0).integers(0, 200, 80)]
                why = first_difference(shipped, folded, record, tokens)

                def per_call(lowering):
                    with PromptSession(lowering, record) as s:
                        s.step(1)
                        t = time.perf_counter()
                        for i in range(CALLS):
                            s.step(i)
                        return (time.perf_counter() - t) / CALLS * 1000
                a, b = per_call(shipped), per_call(folded)
            rows.append({"model": model, "recipe": recipe, "folded": info, "fold_s": round(seconds, 2),
                         "difference": why, "main_ms": round(a, 1), "main_ms_folded": round(b, 1)})
            print(f"{model}/{recipe}: {info}, fold {seconds:.2f} s, {why or 'bit-identical'}, main {a:.1f} -> "
                  f"{b:.1f} ms", flush=True)
    return rows


def main() -> None:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path)
    ap.add_argument("--models", default="rwkv7-tiny,rwkv6-tiny")
    ap.add_argument("--recipes", default="fp32,fp16,int8keepproj,int8keepstate")
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    out = {"layouts": layouts()}
    if ns.results:
        out["folds"] = folds(ns.results, ns.models.split(","), ns.recipes.split(","))
    if ns.json:
        ns.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
