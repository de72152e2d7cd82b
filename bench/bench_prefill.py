#!/usr/bin/env python3
"""Prompt ingestion in the Core AI runtime: the ``main`` loop (one token per call) against the
chunked ``prefill`` entry point (T tokens per call), both functions in ONE bundle, same run.

    python bench/bench_prefill.py [--family rwkv7] [--models tiny 0.1b] [--chunks 16 64 128] [--prompt 512]
                                  [--main-tokens tiny=512 0.1b=32] [--dtype float32] [--profile]

``--family`` (any registered): ``tiny`` is config.yaml's ``<family>-tiny`` model; ``0.1b``
(12 x 768, the RWKV-7 0.1B geometry; 24 x 768, state-spaces/mamba-130m's) exists for rwkv7 and mamba1. Per model and chunk T: the export
stage's conversion (``coreai.convert.convert``: every entry point of ``entrypoints.ENTRY_POINTS``
in one ``.aimodel``, and the decode function alone for the size baseline), lowered, both functions loaded over shared states (``coreai_runtime.PromptSession``),
the prompt fed through ``main`` token by token and through ``prefill`` + ``main`` (tail), tokens/s.
A ``main`` step costs the same at every position (the state has a fixed size), so when
``--main-tokens`` is below the prompt length the main rate is measured on that many tokens
and the 512-token time extrapolated linearly; the output says so. Rates are given per process
CPU second (the runtime runs on the calling thread, so this is the work itself) and per wall
second (inflated whenever other jobs share the cores); the ratio is prefill/main. ``--profile``
adds milliseconds per op kind for one call of each function (coreai.runtime.Profiler).
Results also go to ``bench/out/prefill.json``.
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recurrent_coreai import families  # noqa: E402
from recurrent_coreai.coreai.convert import bundle_bytes, convert  # noqa: E402
from recurrent_coreai.coreai.runtime import PromptSession, lower_universal  # noqa: E402


# ------------------------------------------------------------------------------------------------
# the benchmark
# ------------------------------------------------------------------------------------------------
def op_profile(session: PromptSession, function: str, n_tokens: int) -> dict[str, float]:
    """Milliseconds per op kind for one call of ``function`` (coreai.runtime.Profiler intervals),
    on a copy of the session's states; 'total' is the whole call."""
    import collections
    import itertools

    rt = session._rt
    ids, open_, spent, count = itertools.count(), {}, collections.Counter(), collections.Counter()

    def begin(ev) -> int:
        i = next(ids)
        open_[i] = (time.perf_counter_ns(), ev.event_id)
        return i

    def end(ev, i: int) -> None:
        t0, name = open_.pop(i)
        spent[name] += time.perf_counter_ns() - t0
        count[name] += 1

    fn = session._model.load_function(function, profiler=rt.Profiler(on_log_event_begin=begin, on_log_event_end=end))
    states = {k: rt.NDArray(v) for k, v in session.state_arrays().items()}
    shape = (1, n_tokens)
    inputs = {"input_ids": rt.NDArray(np.ones(shape, np.int32)), "position_ids": rt.NDArray(np.zeros(shape, np.int32))}
    session._loop.run_until_complete(fn(inputs=inputs, state=states))
    out = {"total": spent.pop("Function Execute", 0) / 1e6}
    for name, ns in spent.most_common():
        short = name.replace("call.coreai.", "").replace("decomposable.broadcasting_", "")
        out[f"{short} x{count[name]}"] = round(ns / 1e6, 1)
    return out


def _print_profile(name: str, T: int, prof: dict[str, dict[str, float]]) -> None:
    for fn, ops in prof.items():
        top = ", ".join(f"{k} {v:.0f}" for k, v in list(ops.items())[1:7])
        print(f"  profile {name} T={T} {fn}: {ops['total']:.0f} ms per call; top op kinds (ms): {top}", flush=True)


RWKV7_0_1B = {"layers": 12, "hidden": 768, "head_dim": 64, "ffn": 3072, "vocab": 65536, "decay_lora": 64,
              "a_lora": 64, "v_lora": 32, "gate_lora": 128}
# state-spaces/mamba-130m's geometry (24 x 768, d_state 16, expand 2, dt_rank 48, vocab 50280, tied head)
MAMBA1_130M = {"layers": 24, "hidden": 768, "d_state": 16, "vocab": 50280, "tie_embeddings": True}
SHAPES_0_1B = {"rwkv7": RWKV7_0_1B, "mamba1": MAMBA1_130M}   # the families with a "0.1b" model here


def geometry(family, name: str):
    """(geometry, seed): config.yaml's ``<family>-tiny`` model, or (rwkv7, mamba1) a 0.1B-shaped
    synthetic one (RWKV-7 0.1B: 12 layers, C 768, ffn 3072, LoRA dims 64/64/32/128; mamba-130m:
    24 layers, C 768, d_state 16)."""
    import yaml

    if name == "tiny":
        spec = yaml.safe_load((ROOT / "config.yaml").read_text())["models"][f"{family.name}-tiny"]["source"]
        return family.geometry_from_shape(spec["shape"], "config.yaml"), int(spec["seed"])
    if name == "0.1b" and family.name in SHAPES_0_1B:
        return family.geometry_from_shape(SHAPES_0_1B[family.name], "bench_prefill.py"), 1
    raise SystemExit(f"error: --models: unknown model {name!r} for family {family.name} -- fix: use tiny"
                     + (" or 0.1b" if family.name in SHAPES_0_1B else ""))


def bench_model(family, name: str, chunks: list[int], n_prompt: int, n_main: int, dtype: torch.dtype, tmp: Path,
                profile: bool = False) -> list[dict]:
    g, seed = geometry(family, name)
    decode = family.build_decode(family.synthetic_tensors(g, seed), g, dtype).eval()
    states = tuple(s.name for s in family.state_specs(g))
    prompt = torch.randint(1, g.vocab, (n_prompt,), generator=torch.Generator().manual_seed(7)).tolist()
    n_main = min(n_main, n_prompt)
    rows, main_rate, main_logits = [], None, None
    for T in chunks:
        if n_prompt % T:
            raise SystemExit(f"error: --prompt {n_prompt} is not a multiple of chunk {T} -- fix: choose a multiple")
        t0 = time.perf_counter()
        bundle = tmp / f"T{T}.aimodel"
        converted = convert(family, decode, bundle, T, states)
        export_s = time.perf_counter() - t0
        lowered = tmp / f"T{T}.aimodelx"
        lowered.mkdir()
        lower_universal(bundle, lowered)
        size, decode_only = bundle_bytes(bundle), converted["size_bytes_decode_only"]
        writes = {n: f["state_writes"] for n, f in converted["functions"].items()}
        with PromptSession(lowered, {**converted, "bundle": bundle.name}) as s:
            if main_rate is None:  # the decode graph is the same in every bundle: time it once
                with Clock() as c:
                    for tok in prompt[:n_main]:
                        main_logits = s.step(tok)
                main_rate = c.rates(n_main)
                if n_main < n_prompt:
                    main_logits = None
                s.reset()
            with Clock() as c:
                pre_logits = s.feed(prompt)
            pre_rate = c.rates(n_prompt)
            prof = ({s.function: op_profile(s, s.function, 1), s.prefill_function: op_profile(s, s.prefill_function, T)}
                    if profile else None)
        rows.append({"family": family.name, "model": name, "chunk": T, "state_writes": writes,
                     "export_and_convert_s": round(export_s, 1),
                     "bundle_main_only_bytes": decode_only, "bundle_bytes": size, "size_ratio": round(size / decode_only, 4),
                     "main_tok_s": main_rate, "main_tokens_fed": n_main, "prefill_tok_s": pre_rate,
                     "ratio": {k: round(pre_rate[k] / main_rate[k], 1) for k in pre_rate},
                     "max_abs_dlogits_prefill_vs_main": None if main_logits is None
                     else float(np.abs(pre_logits - main_logits).max())})
        print(_row(rows[-1], n_prompt), flush=True)
        if prof:
            rows[-1]["op_profile_ms"] = prof
            _print_profile(name, T, prof)
        shutil.rmtree(bundle)
        shutil.rmtree(lowered)
    return rows


class Clock:
    """Wall and process-CPU seconds of a block. The runtime executes on the calling thread, so CPU
    time is what the work costs even when other jobs share the cores (wall time then inflates)."""

    def __enter__(self) -> "Clock":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu

    def rates(self, n: int) -> dict[str, float]:
        return {"wall": round(n / self.wall, 2), "cpu": round(n / self.cpu, 2)}


HEADER = (f"{'model':6} {'T':>4} {'main tok/s':>16} {'prefill tok/s':>16} {'ratio':>13} {'bundle MB':>10} "
          f"{'size x':>7} {'export s':>9} {'|dlogit|':>9}  note\n"
          f"{'':11} {'cpu / wall':>16} {'cpu / wall':>16} {'cpu / wall':>13}")


def _row(r: dict, n_prompt: int) -> str:
    note = "" if r["main_tokens_fed"] == n_prompt else f"main rate from {r['main_tokens_fed']} tokens, extrapolated"
    d = "-" if r["max_abs_dlogits_prefill_vs_main"] is None else f"{r['max_abs_dlogits_prefill_vs_main']:.2g}"
    pair = lambda x, f: f"{x['cpu']:{f}} / {x['wall']:{f}}"  # noqa: E731
    return (f"{r['model']:6} {r['chunk']:4d} {pair(r['main_tok_s'], '7.2f'):>16} {pair(r['prefill_tok_s'], '7.1f'):>16} "
            f"{pair(r['ratio'], '5.1f'):>13} {r['bundle_bytes'] / 1e6:10.1f} {r['size_ratio']:7.4f} "
            f"{r['export_and_convert_s']:9.1f} {d:>9}  {note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="rwkv7", choices=families.available())
    ap.add_argument("--models", nargs="+", default=None, help="tiny and (rwkv7, mamba1) 0.1b; default: both for rwkv7, else tiny")
    ap.add_argument("--chunks", nargs="+", type=int, default=[16, 64, 128])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--main-tokens", nargs="+", default=["tiny=512", "0.1b=32"],
                    help="model=N: tokens fed through main to measure its rate")
    ap.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    ap.add_argument("--profile", action="store_true", help="also print ms per op kind for one call of each function")
    ns = ap.parse_args()
    n_main = {k: int(v) for k, v in (item.split("=") for item in ns.main_tokens)}
    dtype = {"float32": torch.float32, "float16": torch.float16}[ns.dtype]
    family = families.get(ns.family)
    models = ns.models or (["tiny", "0.1b"] if family.name == "rwkv7" else ["tiny"])
    print(f"family {family.name}, prompt {ns.prompt} tokens, {ns.dtype}, Core AI Linux runtime (one core); "
          f"|dlogit| = last logits, prefill path vs main path")
    print(HEADER, flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            d = Path(tmp) / name
            d.mkdir()
            rows += bench_model(family, name, ns.chunks, ns.prompt, n_main.get(name, ns.prompt), dtype, d, ns.profile)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak:.0f} MB")
    out = ROOT / "bench" / "out" / "prefill.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"family": family.name, "prompt": ns.prompt, "dtype": ns.dtype, "rows": rows, "peak_rss_mb": round(peak)},
                              indent=2) + "\n")


if __name__ == "__main__":
    main()
