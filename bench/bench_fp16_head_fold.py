"""Whether the gate's fold of an fp16 head (coreai/constant_fold.py, part 3) computes the bits the
Linux runtime's 1 x 1 convolution computes, and what each costs a call.

    python bench/bench_fp16_head_fold.py [--inputs 30] [--json out.json]

A 65536 x 128 fp16 head (a World-vocabulary tiny model's), written as the pipeline writes an fp16
linear (``layers.linear``: a 1 x 1 convolution), and as the fold rewrites it (the fp16 input
widened to fp32, times the weight widened and stored transposed, rounded once to fp16), each
exported, lowered for ``universal`` and called on the same random inputs (scaled 1x to 5x):
ms per call, and how many of the outputs differ in any bit from the convolution's. numpy's fp32
product rounded once is the third row: a sum in another order, to show that the match is not a
property of every fp32 sum.
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

V, C = 65536, 128


def main() -> None:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=30)
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()

    import torch
    import coreai.runtime as rt
    import coreai_torch

    from recurrent_coreai.coreai.layers import linear
    from recurrent_coreai.coreai.runtime import lower_universal

    torch.manual_seed(0)
    weight = (torch.randn(V, C) * 0.05).half()

    class Conv(torch.nn.Module):  # the pipeline's fp16 linear
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(C, V, bias=False).half()
            self.head.weight.data = weight.clone()

        def forward(self, x):
            return linear(self.head, x)

    class Folded(torch.nn.Module):  # the fold's form
        def __init__(self):
            super().__init__()
            self.wt = torch.nn.Parameter(weight.float().T.contiguous())

        def forward(self, x):
            return (x.float() @ self.wt).half()

    xs = [np.random.default_rng(i).standard_normal((1, C)).astype(np.float16) * (1 + i % 5) for i in range(ns.inputs)]

    def run(module) -> tuple[list[np.ndarray], float]:
        ep = torch.export.export(module.eval(), (torch.zeros(1, C, dtype=torch.float16),))
        ep = ep.run_decompositions(coreai_torch.get_decomp_table())
        conv = coreai_torch.TorchConverter(mode=coreai_torch.TorchConverter.Mode.RELEASE)
        conv.add_exported_program(ep, input_names=["x"], output_names=["out"], state_names=[], entrypoint_name="main")
        with tempfile.TemporaryDirectory() as tmp:
            aimodel, lowered = Path(tmp) / "x.aimodel", Path(tmp) / "x.aimodelx"
            conv.to_coreai().save_asset(aimodel)
            lowered.mkdir()
            lower_universal(aimodel, lowered)

            async def calls():
                fn = (await rt.AIModel.load(str(lowered))).load_function("main")
                await fn(inputs={"x": rt.NDArray(xs[0])}, state={})
                outs, t = [], time.perf_counter()
                for x in xs:
                    outs.append((await fn(inputs={"x": rt.NDArray(x)}, state={}))["out"].numpy().copy())
                return outs, (time.perf_counter() - t) / len(xs) * 1000
            return asyncio.run(calls())

    conv_out, conv_ms = run(Conv())
    fold_out, fold_ms = run(Folded())
    numpy_out = [(x.astype(np.float32) @ weight.float().numpy().T).astype(np.float16) for x in xs]

    def differing(outs):
        return int(sum((a.reshape(-1).view(np.uint16) != b.reshape(-1).view(np.uint16)).sum()
                       for a, b in zip(conv_out, outs)))
    rows = [{"form": "1 x 1 conv2d, fp16 (the shipped bundle's)", "ms_per_call": round(conv_ms, 2), "differing": 0},
            {"form": "fp32 x @ Wt rounded once (the gate's fold)", "ms_per_call": round(fold_ms, 2),
             "differing": differing(fold_out)},
            {"form": "numpy fp32 x @ Wt rounded once", "ms_per_call": None, "differing": differing(numpy_out)}]
    for r in rows:
        ms = "-" if r["ms_per_call"] is None else f"{r['ms_per_call']:.2f} ms/call"
        print(f"{r['form']:45s} {ms:>14s}  {r['differing']} of {len(xs) * V} outputs differ from the conv2d's")
    if ns.json:
        ns.json.write_text(json.dumps({"inputs": len(xs), "outputs": len(xs) * V, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
