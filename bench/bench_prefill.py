#!/usr/bin/env python3
"""Prompt ingestion in the Core AI runtime: the ``main`` loop (one token per call) against the
chunked ``prefill`` entry point (T tokens per call), both functions in ONE bundle, same run.

    python bench/bench_prefill.py [--models tiny 0.1b] [--chunks 16 64 128] [--prompt 512]
                                  [--main-tokens tiny=512 0.1b=32] [--dtype float32] [--profile]

Per model: export ``main`` once, convert it alone (size baseline), then per chunk T export
``prefill``, convert main + prefill into one ``.aimodel``, lower it, load both functions over
shared states, feed the prompt through ``main`` and through ``prefill`` and print tokens/s.
A ``main`` step costs the same at every position (the state has a fixed size), so when
``--main-tokens`` is below the prompt length the main rate is measured on that many tokens
and the 512-token time extrapolated linearly; the output says so. Rates are given per process
CPU second (the runtime runs on the calling thread, so this is the work itself) and per wall
second (inflated whenever other jobs share the cores); the ratio is prefill/main. ``--profile``
adds milliseconds per op kind for one call of each function (coreai.runtime.Profiler).
Results also go to ``bench/out/prefill.json``.

The first section (export + runtime glue) is what moves into ``export.py`` and
``coreai_runtime.py``; tests/test_chunked.py imports it from here until then.
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
from typing import Mapping

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rwkv7_coreai.chunked import split_prompt  # noqa: E402
from rwkv7_coreai.coreai_runtime import DecodeSession, lower_universal  # noqa: E402
from rwkv7_coreai.errors import PipelineError  # noqa: E402
from rwkv7_coreai.export import REPRODUCIBLE_EPOCH, example_inputs, state_writes  # noqa: E402
from rwkv7_coreai.export_graph import (INPUT_NAMES, OUTPUT_NAMES, STATE_NAMES, build_decode,  # noqa: E402
                                       build_prefill, prefill_example_inputs)
from rwkv7_coreai.geometry import Geometry  # noqa: E402


# ------------------------------------------------------------------------------------------------
# glue: export.py (an entry-point table staged on one converter)
# ------------------------------------------------------------------------------------------------
def export_program(module: torch.nn.Module, example: tuple) -> tuple[object, dict[str, int]]:
    """torch.export + coreai-torch decompositions; also the writes per state (export.state_writes,
    counted before functionalisation merges them)."""
    import coreai_torch

    ep = torch.export.export(module, example)
    writes = state_writes(ep)
    return ep.run_decompositions(coreai_torch.get_decomp_table()), writes


def save_functions(programs: Mapping[str, object], out: Path) -> None:
    """One ``.aimodel`` holding every exported program under its entry-point name (weights of
    identical value, dtype and shape are stored once)."""
    import coreai_torch
    from coreai.authoring.asset import AIModelAsset

    converter = coreai_torch.TorchConverter(mode=coreai_torch.TorchConverter.Mode.RELEASE)
    for name, ep in programs.items():
        converter.add_exported_program(ep, input_names=list(INPUT_NAMES), output_names=list(OUTPUT_NAMES),
                                       state_names=list(STATE_NAMES), entrypoint_name=name)
    converter.to_coreai().save_asset(out)
    AIModelAsset.load(out).update_metadata(lambda m: setattr(m, "creation_date", REPRODUCIBLE_EPOCH))


def bundle_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ------------------------------------------------------------------------------------------------
# glue: coreai_runtime.py (prefill + main over the same states)
# ------------------------------------------------------------------------------------------------
def state_shapes(g: Geometry) -> dict[str, tuple[int, ...]]:
    return {"recState": (g.layers, 1, g.heads, g.head_dim, g.head_dim), "shiftState": (g.layers, 1, 2, g.hidden)}


class PromptSession(DecodeSession):
    """A :class:`DecodeSession` that also runs ``prefill`` (``chunk`` tokens per call) on the same
    states: :meth:`feed` sends the full chunks of a prompt through ``prefill`` and its tail
    (fewer than ``chunk`` tokens) through ``main``, token by token — no padding."""

    def __init__(self, aimodelx: Path, state_shapes: dict, state_dtype, chunk: int):
        super().__init__(aimodelx, state_shapes, state_dtype)
        try:
            self._prefill = self._model.load_function("prefill")
        except Exception as exc:  # noqa: BLE001 - runtime errors have many types
            self.close()
            raise PipelineError(aimodelx, f"has no loadable function 'prefill' ({type(exc).__name__}: {exc})",
                                "re-export the bundle with the prefill entry point") from None
        self.chunk = chunk

    def prefill_chunk(self, tokens) -> np.ndarray:
        """Exactly ``chunk`` tokens through ``prefill``; logits of the last one [V]."""
        assert len(tokens) == self.chunk, (len(tokens), self.chunk)
        ids = self._rt.NDArray(np.asarray(tokens, dtype=np.int32).reshape(1, self.chunk))
        pos = self._rt.NDArray(np.zeros((1, self.chunk), dtype=np.int32))
        res = self._loop.run_until_complete(
            self._prefill(inputs={"input_ids": ids, "position_ids": pos}, state=self.states))
        return np.asarray(res["logits"].numpy()).reshape(-1).astype(np.float64)

    def feed(self, tokens) -> np.ndarray:
        """A whole prompt (at least one token); logits after its last token [V]."""
        tokens = list(tokens)
        full = split_prompt(len(tokens), self.chunk)[0] * self.chunk
        logits = None
        for start in range(0, full, self.chunk):
            logits = self.prefill_chunk(tokens[start:start + self.chunk])
        for t in tokens[full:]:
            logits = self.step(t)
        return logits


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


def geometry(name: str) -> tuple[Geometry, int]:
    """(shape, seed): the default tiny model of config.yaml, or a 0.1B-shaped synthetic one
    (RWKV-7 0.1B: 12 layers, C 768, ffn 3072, LoRA dims 64/64/32/128)."""
    import yaml

    if name == "tiny":
        spec = yaml.safe_load((ROOT / "config.yaml").read_text())["models"]["rwkv7-tiny"]["source"]
        return Geometry(**spec["shape"]), int(spec["seed"])
    if name == "0.1b":
        return Geometry(layers=12, hidden=768, head_dim=64, ffn=3072, vocab=65536, decay_lora=64, a_lora=64,
                        v_lora=32, gate_lora=128), 1
    raise SystemExit(f"error: --models: unknown model {name!r} -- fix: use tiny or 0.1b")


def bench_model(name: str, chunks: list[int], n_prompt: int, n_main: int, dtype: torch.dtype, tmp: Path,
                profile: bool = False) -> list[dict]:
    from rwkv7_coreai.synthetic import synthetic_state_dict

    g, seed = geometry(name)
    decode = build_decode(synthetic_state_dict(g, seed), g, dtype)
    prompt = torch.randint(1, g.vocab, (n_prompt,), generator=torch.Generator().manual_seed(7)).tolist()
    n_main = min(n_main, n_prompt)
    t0 = time.perf_counter()
    ep_main, _ = export_program(decode, example_inputs())
    export_main_s = time.perf_counter() - t0
    save_functions({"main": ep_main}, tmp / "main.aimodel")
    main_only = bundle_bytes(tmp / "main.aimodel")
    shutil.rmtree(tmp / "main.aimodel")
    npdt = np.float32 if dtype == torch.float32 else np.float16
    rows, main_rate, main_logits = [], None, None
    for T in chunks:
        if n_prompt % T:
            raise SystemExit(f"error: --prompt {n_prompt} is not a multiple of chunk {T} -- fix: choose a multiple")
        t0 = time.perf_counter()
        ep_pre, writes = export_program(build_prefill(decode, T), prefill_example_inputs(T))
        bundle = tmp / f"T{T}.aimodel"
        save_functions({"main": ep_main, "prefill": ep_pre}, bundle)
        export_s = time.perf_counter() - t0
        lowered = tmp / f"T{T}.aimodelx"
        lowered.mkdir()
        lower_universal(bundle, lowered)
        with PromptSession(lowered, state_shapes(g), npdt, T) as s:
            if main_rate is None:  # the main graph is the same ep in every bundle: time it once
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
            prof = {"main": op_profile(s, "main", 1), "prefill": op_profile(s, "prefill", T)} if profile else None
        rows.append({"model": name, "chunk": T, "prefill_state_writes": writes,
                     "export_main_s": round(export_main_s, 1), "export_prefill_and_convert_s": round(export_s, 1),
                     "bundle_main_only_bytes": main_only, "bundle_bytes": bundle_bytes(bundle),
                     "size_ratio": round(bundle_bytes(bundle) / main_only, 4),
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
            f"{r['export_prefill_and_convert_s']:9.1f} {d:>9}  {note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "0.1b"])
    ap.add_argument("--chunks", nargs="+", type=int, default=[16, 64, 128])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--main-tokens", nargs="+", default=["tiny=512", "0.1b=32"],
                    help="model=N: tokens fed through main to measure its rate")
    ap.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    ap.add_argument("--profile", action="store_true", help="also print ms per op kind for one call of each function")
    ns = ap.parse_args()
    n_main = {k: int(v) for k, v in (item.split("=") for item in ns.main_tokens)}
    dtype = {"float32": torch.float32, "float16": torch.float16}[ns.dtype]
    print(f"prompt {ns.prompt} tokens, {ns.dtype}, Core AI Linux runtime (one core); "
          f"|dlogit| = last logits, prefill path vs main path")
    print(HEADER, flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ns.models:
            d = Path(tmp) / name
            d.mkdir()
            rows += bench_model(name, ns.chunks, ns.prompt, n_main.get(name, ns.prompt), dtype, d, ns.profile)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak:.0f} MB")
    out = ROOT / "bench" / "out" / "prefill.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"prompt": ns.prompt, "dtype": ns.dtype, "rows": rows, "peak_rss_mb": round(peak)},
                              indent=2) + "\n")


if __name__ == "__main__":
    main()
