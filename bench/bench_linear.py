#!/usr/bin/env python3
"""How the graph writes its linears, and what that costs per call in the Core AI Linux runtime.

    python bench/bench_linear.py [--shapes 0.1b 1.5b-w2] [--recipes fp32 fp16 int8keepproj]
                                 [--forms linear wxt] [--main-calls 5] [--prefill-calls 3] [--profile]

RWKV-7 only: it swaps the helper the RWKV-7 export graph calls (``families/rwkv7/export_graph``'s
module-level ``linear``, i.e. ``coreai.layers.linear``) and builds RWKV-7 shapes. Every linear of
that graph goes through ``linear(mod, x)``. This bench swaps that one function for each form of
``--forms`` and, per shape x recipe x form, exports the bundle the export stage would
(``coreai.convert.convert``: main + prefill, T = 64, quantised per linear as
``stages.export.load_module`` does, and the decode function alone for the size baseline),
lowers it (universal) and times ``main`` (T = 1) and ``prefill`` (T = 64) in the runtime in
process CPU seconds per call (median of the timed calls, after one untimed call of each;
the runtime runs on the calling thread, so this is the work itself even when other jobs share
the cores). It also records the bundle size with and without prefill, the state writes and
quantised weights per function, the logits of the same inputs (one prefill chunk, then main
steps) against the first form's in the runtime and eagerly in torch, and against eager fp32
torch with nn.Linear (the fp32 reference for the fp16 recipes); with ``--profile``
milliseconds per op kind for one call of each function (coreai.runtime.Profiler).

Forms:
  linear  ``mod(x)``: nn.Linear -> F.linear -> permute(W) + addmm; Core AI gets
          ``transpose(W)`` then ``batch_matmul(x, Wᵀ)``, and the runtime transposes the
          constant weight on every call.
  xwt     ``torch.matmul(x, W.T)`` written out: the same graph as ``linear``.
  wxt     ``(W · xᵀ)ᵀ``: ``torch.matmul(W, x.transpose(-1, -2)).transpose(-1, -2)`` (+ bias):
          only activations are transposed, the weight is used as stored.
  conv    a 1x1 convolution: ``F.conv1d(xᵀ[None], W[..., None], b)[0]ᵀ``; Core AI gets
          ``conv2d`` over the weight as stored (the converter folds the reshape into the constant).
  wxt32   ``wxt`` over fp32 casts of x and W (the weight stays fp16/int8 in the file), cast back:
          an fp32 running sum in the runtime.
  linear32  ``F.linear`` the same way (notes/issue13: the first measured fix).
  conv32  ``conv`` the same way.
  adopted ``export_graph.linear`` as the module defines it (what the export stage uses).

With ``--linears OUTxIN …`` it times ONE linear per recipe, ``--tokens`` T and form instead
(a stateless bundle; ``--main-calls`` timed calls each).

Shapes: ``tiny`` (config.yaml's rwkv7-tiny, 2 x 128: a smoke run), ``0.1b`` (12 layers x 768, ffn 3072, vocab 65536) and ``1.5b-wN`` (N layers of the
1.5B width: hidden 2048, ffn 8192, LoRA 96/96/64/256, with the 65536 x 2048 embeddings and
lm_head). Synthetic weights (recurrent_coreai.families.rwkv7.synthetic). Results go to bench/out/linear.json
(merged with what is there, keyed by shape/recipe/form).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_prefill import op_profile  # noqa: E402

from recurrent_coreai import families  # noqa: E402
from recurrent_coreai.coreai import quantize  # noqa: E402
from recurrent_coreai.coreai.convert import (bundle_bytes, check_quantized, convert,  # noqa: E402
                                             map_large_allocations, trim_heap)
from recurrent_coreai.coreai.runtime import PromptSession, lower_universal  # noqa: E402
from recurrent_coreai.families.rwkv7 import export_graph  # noqa: E402
from recurrent_coreai.families.rwkv7.export_graph import RWKV7Decode  # noqa: E402
from recurrent_coreai.families.rwkv7.geometry import Geometry  # noqa: E402
from recurrent_coreai.stages.export import DTYPES  # noqa: E402

FAMILY = families.get("rwkv7")

CHUNK = 64
SEED = 1
OUT = ROOT / "bench" / "out" / "linear.json"


def _bias(mod, y):
    return y if mod.bias is None else y + mod.bias


def _wide(mod, x, product):
    """``product`` in fp32 over fp32 casts of x and the weight, bias added in fp32, cast back to x's dtype."""
    y = product(mod.weight.float(), x.float())
    return (y if mod.bias is None else y + mod.bias.float()).to(x.dtype)


ADOPTED = export_graph.linear  # the graph's own helper, as the module defines it
FORMS = {
    "linear": lambda mod, x: mod(x),
    "xwt": lambda mod, x: _bias(mod, torch.matmul(x, mod.weight.transpose(0, 1))),
    "wxt": lambda mod, x: _bias(mod, torch.matmul(mod.weight, x.transpose(-1, -2)).transpose(-1, -2)),
    "conv": lambda mod, x: F.conv1d(x.transpose(0, 1).unsqueeze(0), mod.weight.unsqueeze(-1), mod.bias)
    .squeeze(0).transpose(0, 1),
    "wxt32": lambda mod, x: _wide(mod, x, lambda w, v: torch.matmul(w, v.transpose(-1, -2)).transpose(-1, -2)),
    "linear32": lambda mod, x: _wide(mod, x, lambda w, v: F.linear(v, w)),
    "conv32": lambda mod, x: _wide(mod, x, lambda w, v: F.conv1d(v.transpose(0, 1).unsqueeze(0), w.unsqueeze(-1))
                                   .squeeze(0).transpose(0, 1)),
    "adopted": ADOPTED,
}


def geometry(name: str) -> Geometry:
    if name == "tiny":  # config.yaml's rwkv7-tiny (2 x 128): a smoke run
        import yaml

        shape = yaml.safe_load((ROOT / "config.yaml").read_text())["models"]["rwkv7-tiny"]["source"]["shape"]
        return FAMILY.geometry_from_shape(shape, "config.yaml")
    if name == "0.1b":
        return Geometry(layers=12, hidden=768, head_dim=64, ffn=3072, vocab=65536, decay_lora=64, a_lora=64,
                        v_lora=32, gate_lora=128)
    if name.startswith("1.5b-w"):
        return Geometry(layers=int(name.removeprefix("1.5b-w")), hidden=2048, head_dim=64, ffn=8192, vocab=65536,
                        decay_lora=96, a_lora=96, v_lora=64, gate_lora=256)
    raise SystemExit(f"error: --shapes: unknown shape {name!r} -- fix: use tiny, 0.1b or 1.5b-wN")


def states(g: Geometry) -> tuple[str, ...]:
    return tuple(s.name for s in FAMILY.state_specs(g))


def build(sd: dict, g: Geometry, recipe: dict, recipe_name: str = "?") -> tuple[RWKV7Decode, list[dict]]:
    """As stages.export.load_module, from an in-memory state dict."""
    dtype = DTYPES[recipe["dtype"]]
    q = recipe.get("quantize")
    if not q:
        return FAMILY.build_decode(sd, g, dtype), []
    q = quantize.resolve_roles(q, FAMILY.roles, recipe_name)
    layers = quantize.plan(FAMILY.decode_skeleton(g, dtype), q, recipe["dtype"])
    chosen = set(quantize.chosen(layers, q, recipe_name))
    module = FAMILY.build_decode(sd, g, dtype, lambda n, lin: quantize.quantize_linear(lin, q) if n in chosen else lin)
    quantize.check_done(module, sorted(chosen))
    return module, layers


def eager_logits(module: RWKV7Decode, prompt: list[int], steps: list[int]) -> np.ndarray:
    """Logits after one prefill chunk, then after each main step (eager torch; states reset first)."""
    module.reset()
    pre = export_graph.build_prefill(module, CHUNK)
    out = []
    with torch.no_grad():
        ids = torch.tensor([prompt], dtype=torch.int32)
        out.append(pre(ids, torch.zeros_like(ids)).reshape(-1))
        for t in steps:
            ids = torch.tensor([[t]], dtype=torch.int32)
            out.append(module(ids, torch.zeros_like(ids)).reshape(-1))
    module.reset()
    return torch.stack(out).double().numpy()


def inputs(g: Geometry, n_steps: int) -> tuple[list[int], list[int]]:
    """One prefill chunk of tokens, then ``n_steps`` tokens for main (fixed seed)."""
    gen = torch.Generator().manual_seed(7)
    return (torch.randint(1, g.vocab, (CHUNK,), generator=gen).tolist(),
            torch.randint(1, g.vocab, (n_steps,), generator=gen).tolist())


def cpu_per_call(fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return times


def run_one(shape: str, g: Geometry, sd: dict, recipe_name: str, recipe: dict, form: str, tmp: Path, ns) -> dict:
    export_graph.linear = FORMS[form]
    module, layers = build(sd, g, recipe, recipe_name)
    prompt, steps = inputs(g, ns.check_steps)
    eager = eager_logits(module, prompt, steps) if ns.eager else None
    bundle = tmp / f"{shape}-{recipe_name}-{form}.aimodel"
    t0 = time.perf_counter()
    converted = convert(FAMILY, module, bundle, CHUNK, states(g), decode_only=ns.decode_only, release=True)
    export_s = time.perf_counter() - t0
    del module
    trim_heap()
    check_quantized(converted["functions"], layers, recipe_name)
    lowered = tmp / f"{shape}-{recipe_name}-{form}.aimodelx"
    lowered.mkdir()
    lower_universal(bundle, lowered)
    row = {"shape": shape, "recipe": recipe_name, "form": form, "export_s": round(export_s, 1),
           "bundle_bytes": bundle_bytes(bundle), "bundle_bytes_decode_only": converted["size_bytes_decode_only"],
           "lowered_bytes": bundle_bytes(lowered),
           "state_writes": {n: f["state_writes"] for n, f in converted["functions"].items()},
           "quantized_weights": {n: f["quantized_weights"] for n, f in converted["functions"].items()},
           "planned_quantized": sum(r["action"].startswith("int") for r in layers)}
    with PromptSession(lowered, converted) as s:
        logits = [s.prefill_chunk(prompt)] + [s.step(t) for t in steps]   # also the untimed first calls
        row["logits"] = np.stack(logits)
        row["eager_logits"] = eager
        main = cpu_per_call(lambda: s.step(1), ns.main_calls)
        pre = cpu_per_call(lambda: s.prefill_chunk(prompt), ns.prefill_calls)
        row["main_cpu_s"] = {"median": round(statistics.median(main), 4), "min": round(min(main), 4), "n": len(main)}
        row["prefill_cpu_s"] = {"median": round(statistics.median(pre), 4), "min": round(min(pre), 4), "n": len(pre)}
        if ns.profile and (not ns.profile_forms or form in ns.profile_forms):
            row["op_profile_ms"] = {s.function: op_profile(s, s.function, 1),
                                    s.prefill_function: op_profile(s, s.prefill_function, CHUNK)}
    for p in (bundle, lowered):
        import shutil
        shutil.rmtree(p)
    return row


class One(torch.nn.Module):
    def __init__(self, lin: torch.nn.Linear, form: str):
        super().__init__()
        self.lin, self.form = lin, form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FORMS[self.form](self.lin, x)


def one_linear(out_f: int, in_f: int, recipe_name: str, recipe: dict, T: int, form: str, tmp: Path, n: int) -> dict:
    """ONE linear (no bias) of the recipe's dtype (quantised as the recipe's FFN would be) as a
    stateless bundle: CPU ms per call (median of n after one untimed), |Δ| against eager torch."""
    import asyncio
    import shutil

    import coreai.runtime as rt
    import coreai_torch

    torch.manual_seed(0)
    dtype = DTYPES[recipe["dtype"]]
    lin = torch.nn.Linear(in_f, out_f, bias=False).to(dtype)
    if recipe.get("quantize"):
        lin = quantize.quantize_linear(lin, recipe["quantize"])
    x = torch.randn(T, in_f, dtype=dtype)
    with torch.no_grad():
        ref = lin(x).float().numpy()
    ep = torch.export.export(One(lin, form), (x,)).run_decompositions(coreai_torch.get_decomp_table())
    conv = coreai_torch.TorchConverter(mode=coreai_torch.TorchConverter.Mode.RELEASE)
    conv.add_exported_program(ep, input_names=["x"], output_names=["y"], entrypoint_name="main")
    bundle, lowered = tmp / "one.aimodel", tmp / "one.aimodelx"
    conv.to_coreai().save_asset(bundle)
    lowered.mkdir()
    lower_universal(bundle, lowered)
    loop = asyncio.new_event_loop()
    model = loop.run_until_complete(rt.AIModel.load(str(lowered)))
    fn, xin = model.load_function("main"), rt.NDArray(x.numpy())
    y = np.asarray(loop.run_until_complete(fn(inputs={"x": xin}))["y"].numpy()).astype(np.float32)
    times = cpu_per_call(lambda: loop.run_until_complete(fn(inputs={"x": xin})), n)
    row = {"linear": f"{out_f}x{in_f}", "recipe": recipe_name, "T": T, "form": form,
           "cpu_ms": round(1e3 * statistics.median(times), 2), "bundle_bytes": bundle_bytes(bundle),
           "max_abs_diff_vs_eager": float(np.abs(y - ref).max())}
    fn = model = None
    loop.close()
    shutil.rmtree(bundle)
    shutil.rmtree(lowered)
    return row


def main() -> None:
    import yaml

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["0.1b", "1.5b-w2"])
    ap.add_argument("--recipes", nargs="+", default=["fp32", "fp16", "int8keepproj"])
    ap.add_argument("--forms", nargs="+", default=["linear", "wxt"], choices=sorted(FORMS))
    ap.add_argument("--main-calls", type=int, default=5)
    ap.add_argument("--prefill-calls", type=int, default=3)
    ap.add_argument("--check-steps", type=int, default=3, help="main steps after the prefill chunk whose logits are compared")
    ap.add_argument("--no-decode-only", dest="decode_only", action="store_false",
                    help="skip the decode-only conversion (size baseline)")
    ap.add_argument("--no-eager", dest="eager", action="store_false", help="skip the eager torch logits")
    ap.add_argument("--profile", action="store_true", help="ms per op kind for one call of each function")
    ap.add_argument("--profile-forms", nargs="+", help="profile only these forms (default: all)")
    ap.add_argument("--tmp", type=Path, default=None)
    ap.add_argument("--linears", nargs="+", metavar="OUTxIN",
                    help="instead of models: one linear each (e.g. 8192x2048), at --tokens T, per recipe and form")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 64])
    ns = ap.parse_args()
    recipes = yaml.safe_load((ROOT / "config.yaml").read_text())["recipes"]
    torch.set_num_threads(1)
    map_large_allocations()
    results = json.loads(OUT.read_text()) if OUT.is_file() else {}
    if ns.linears:
        with tempfile.TemporaryDirectory(dir=ns.tmp) as tmp:
            for spec in ns.linears:
                out_f, in_f = (int(v) for v in spec.split("x"))
                for r in ns.recipes:
                    for T in ns.tokens:
                        for f in ns.forms:
                            row = one_linear(out_f, in_f, r, recipes[r], T, f, Path(tmp), ns.main_calls)
                            results[f"linear {spec}/{r}/T{T}/{f}"] = row
                            print(json.dumps(row), flush=True)
                            OUT.parent.mkdir(parents=True, exist_ok=True)
                            OUT.write_text(json.dumps(results, indent=2) + "\n")
        return
    with tempfile.TemporaryDirectory(dir=ns.tmp) as tmp:
        for shape in ns.shapes:
            g = geometry(shape)
            sd = synthetic_sd(g)
            export_graph.linear = FORMS["linear"]
            ref32 = eager_logits(FAMILY.build_decode(sd, g, torch.float32), *inputs(g, ns.check_steps)) if ns.eager else None
            for r in ns.recipes:
                rows = [run_one(shape, g, sd, r, recipes[r], f, Path(tmp), ns) for f in ns.forms]
                base = rows[0]
                for row in rows:
                    row["max_abs_dlogits_runtime_vs_" + base["form"]] = float(np.abs(row["logits"] - base["logits"]).max())
                    if ns.eager:
                        row["max_abs_dlogits_eager_vs_" + base["form"]] = float(
                            np.abs(row["eager_logits"] - base["eager_logits"]).max())
                        row["max_abs_dlogits_runtime_vs_eager"] = float(np.abs(row["logits"] - row["eager_logits"]).max())
                        row["max_abs_dlogits_runtime_vs_eager_fp32_linear"] = float(np.abs(row["logits"] - ref32).max())
                for row in rows:
                    row.pop("logits"), row.pop("eager_logits")
                    row["bundle_vs_" + base["form"]] = round(row["bundle_bytes"] / base["bundle_bytes"], 6)
                    results[f"{shape}/{r}/{row['form']}"] = row
                    print(_line(row), flush=True)
                    if "op_profile_ms" in row:
                        for fn, ops in row["op_profile_ms"].items():
                            top = ", ".join(f"{k} {v:.0f}" for k, v in list(ops.items())[1:6])
                            print(f"    profile {fn}: {ops['total']:.0f} ms wall; top (ms): {top}", flush=True)
                OUT.parent.mkdir(parents=True, exist_ok=True)
                OUT.write_text(json.dumps(results, indent=2) + "\n")
            del sd
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


def synthetic_sd(g: Geometry) -> dict:
    from recurrent_coreai.families.rwkv7.synthetic import synthetic_state_dict

    return synthetic_state_dict(g, SEED)


def _line(r: dict) -> str:
    d = r.get("bundle_bytes_decode_only")
    dl = [f"{k.removeprefix('max_abs_dlogits_')} {v:.2g}" for k, v in r.items() if k.startswith("max_abs_dlogits")]
    return (f"{r['shape']:8} {r['recipe']:13} {r['form']:7} main {r['main_cpu_s']['median']:8.3f} s  "
            f"prefill {r['prefill_cpu_s']['median']:8.3f} s  bundle {r['bundle_bytes'] / 1e6:9.2f} MB "
            f"(x{r['bundle_vs_' + 'linear'] if 'bundle_vs_linear' in r else 1:.6f}; decode-only "
            f"{'-' if d is None else f'{d / 1e6:.2f} MB'})  writes {r['state_writes']}  q {r['quantized_weights']}/"
            f"{r['planned_quantized']}  export {r['export_s']} s  |dlogits| {'; '.join(dl)}")


if __name__ == "__main__":
    main()
