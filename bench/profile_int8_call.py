#!/usr/bin/env python3
"""Where one decode call's time goes in the Linux Core AI runtime, fp16 against int8keepproj, and
what folding the int8 dequantisation once per gate (from the shipped bundle's bytes) does to it
(issue 27, item 2). Measurements: docs/measurements/2026-12-02-int8-call-profile.md.

    python bench/profile_int8_call.py [--shapes 0.1b 0.4b] [--recipes fp16 int8keepproj]
                                      [--work /tmp/helper-prof-work] [--calls 2] [--steps 8]
                                      [--fast-kernels] [--json PATH]

Per shape (RWKV-7 of the real 0.1B / 0.4B geometry with synthetic weights: a config.yaml copy in
``--work`` gets ``rwkv7-<shape>-shape`` entries made from ``rwkv7-1.5b-shape``), the pipeline's own
stage scripts build what is missing (scripts/source.py, export.py, aot.py --target universal), one
process at a time. Then, each in a process of its own:

* ``profile``: the lowered bundle loaded as the gate loads it (``PromptSession``), its decode
  function loaded again with a ``coreai.runtime.Profiler``; one untimed call, then ``--calls``
  calls of ``sess.step``; per call the wall and the process CPU seconds, and the runtime's own
  per-op intervals (``call.coreai.<op>``) of the last call, summed by op.
* ``specialise`` (quantised recipes): :func:`specialise_lowering` (the gate's
  ``coreai/constant_fold.py``) reads the shipped ``.aimodel``'s ``main.mlirb``, replaces every
  ``coreai.blockwise_shift_scale`` of constants by the constant it computes, and lowers that (the
  universal lowering, specialised once). Then ``compare`` feeds the
  same prompt (one prefill chunk + 3 decode tokens) and ``--steps`` decode tokens through the
  pipeline's lowering and the specialised one and checks logits and states bit for bit, and
  ``profile`` profiles the specialised lowering.
* with ``--fast-kernels`` also ``profile`` under ``COREAI_FAST_KERNELS=1`` (a runtime switch found
  in the runtime's strings) and the logits compared with the default run's.

Wall seconds on a shared machine move with its load; CPU seconds of the process (the runtime
runs a call on one thread) much less. Results: stdout and ``--json`` (default
``<work>/profile-int8-call.json``).

The child commands run alone too (e.g. under ``perf record``)::

    python bench/profile_int8_call.py profile AIMODELX EXPORT_JSON CALLS OUT.json
    python bench/profile_int8_call.py specialise AIMODEL OUT.aimodelx OUT.json
    python bench/profile_int8_call.py compare SHIPPED.aimodelx SPECIALISED.aimodelx EXPORT_JSON STEPS OUT.json
    python bench/profile_int8_call.py passes AIMODEL PIPELINE before|after OUT.aimodelx

``passes`` runs an MLIR pass pipeline (e.g. ``"builtin.module(fold-constexpr-ops)"``, or ``none``)
on a bundle's IR before the universal lowering or on the lowered ODIX module after it, lowers,
and prints the blockwise_shift_scale ops left (before) or whether the ODIX ops changed (after),
and the ``.odix`` size.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # the published RWKV-7 geometries (fla configs of RWKV7-Goose-World3-0.1B/0.4B)
    "0.1b": dict(layers=12, hidden=768, head_dim=64, ffn=3072, vocab=65536, decay_lora=64, a_lora=64, v_lora=32,
                 gate_lora=128),
    "0.4b": dict(layers=24, hidden=1024, head_dim=64, ffn=4096, vocab=65536, decay_lora=64, a_lora=64, v_lora=32,
                 gate_lora=128),
}
def specialise_lowering(aimodel: Path, out_dir: Path) -> dict:
    """The gate's folded lowering (``recurrent_coreai.coreai.constant_fold``, used by every quantised
    gate since 2026-12-02: stages/gate_lowering.py), with the ``.odix`` size."""
    from recurrent_coreai.coreai.constant_fold import fold_constants

    out_dir.mkdir(parents=True, exist_ok=True)
    rec = fold_constants(aimodel, out_dir)
    return {**rec, "odix_bytes": (out_dir / "main-universal.odix").stat().st_size}


# ---------------------------------------------------------------------------------------------
# child-process commands


def prompt_tokens(steps: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(20261202)
    return rng.integers(0, 65536, 64 + 3).tolist(), rng.integers(0, 65536, steps).tolist()


def cmd_profile(aimodelx: Path, export_json: Path, calls: int, out: Path) -> None:
    """One warm-up call then ``calls`` decode calls through PromptSession, as the gate makes them."""
    import coreai.runtime as rt

    from recurrent_coreai.coreai.runtime import PromptSession

    begins: dict[int, tuple[int, str]] = {}
    ends: list[tuple[int, int]] = []
    counter = [0]

    def begin(event) -> int:
        counter[0] += 1
        begins[counter[0]] = (event.timestamp, event.event_id)
        return counter[0]

    def end(event, interval: int) -> None:
        ends.append((interval, event.timestamp))

    record = json.loads(export_json.read_text())
    t0 = time.perf_counter()
    with PromptSession(aimodelx, record) as sess:
        load_s = time.perf_counter() - t0
        # the session's decode function, loaded again with a profiler (the gate's session otherwise)
        sess._fn = sess._model.load_function(sess.function, profiler=rt.Profiler(  # noqa: SLF001
            on_log_event_begin=begin, on_log_event_end=end))
        rows, logits = [], []
        for i in range(calls + 1):
            c, w = time.process_time(), time.perf_counter()
            logits.append(sess.step(1000 + i))
            rows.append({"wall_s": round(time.perf_counter() - w, 3), "cpu_s": round(time.process_time() - c, 3)})
        time.sleep(0.2)  # the last intervals' end events arrive from the runtime's thread
    executes = sorted(begins[i][0] for i, _ in ends if begins[i][1] == "Function Execute")
    last = executes[-1]
    by_op: dict[str, list] = {}
    for i, ts in ends:
        start, name = begins[i]
        if start >= last:
            row = by_op.setdefault(name, [0, 0.0])
            row[0] += 1
            row[1] += (ts - start) / 1e9
    np.save(out.with_suffix(".npy"), np.stack(logits))
    out.write_text(json.dumps({"load_s": round(load_s, 2), "calls": rows, "last_call_by_op": {
        k: {"count": n, "seconds": round(s, 4)} for k, (n, s) in sorted(by_op.items(), key=lambda kv: -kv[1][1])},
        "loadavg": os.getloadavg()}, indent=1))


def cmd_compare(shipped: Path, special: Path, export_json: Path, steps: int, out: Path) -> None:
    from recurrent_coreai.coreai.runtime import PromptSession

    record = json.loads(export_json.read_text())
    prompt, cont = prompt_tokens(steps)
    got = {}
    for name, path in (("shipped", shipped), ("specialised", special)):
        with PromptSession(path, record) as sess:
            t = time.perf_counter()
            logits = [sess.feed(prompt)] + [sess.step(tok) for tok in cont]
            got[name] = (np.stack(logits), sess.state_arrays(), time.perf_counter() - t)
    a, b = got["shipped"], got["specialised"]
    out.write_text(json.dumps({
        "calls": 1 + 3 + steps, "logits_bit_identical": bool(np.array_equal(a[0], b[0])),
        "max_abs_dlogits": float(np.abs(a[0] - b[0]).max()),
        "states_bit_identical": all(np.array_equal(a[1][k], b[1][k]) for k in a[1]),
        "shipped_s": round(a[2], 1), "specialised_s": round(b[2], 1)}, indent=1))


def cmd_specialise(aimodel: Path, out_dir: Path, out: Path) -> None:
    import resource
    t = time.perf_counter()
    rec = specialise_lowering(aimodel, out_dir)
    rec["seconds"] = round(time.perf_counter() - t, 1)
    rec["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    out.write_text(json.dumps(rec, indent=1))


def cmd_passes(aimodel: Path, pipeline: str, where: str, out: Path) -> None:
    from coreai.authoring.asset import Context  # first: coreai.authoring's imports are order-sensitive
    from coreai._compiler._mlir_libs._coreaiIR._bindings.compiler import (compile_to_binary,
                                                                          load_module_from_bytecode,
                                                                          serialize_module)
    from coreai._compiler.ir import WalkResult
    from coreai._compiler.passmanager import PassManager

    ctx = Context()._mlir_context  # noqa: SLF001
    module = load_module_from_bytecode(context=ctx, path=aimodel / "main.mlirb")

    def count() -> dict[str, int]:
        n: dict[str, int] = {}

        def visit(op):
            n[op.name] = n.get(op.name, 0) + 1
            return WalkResult.ADVANCE
        module.operation.walk(visit)
        return n

    def run() -> None:
        if pipeline != "none":
            with ctx:
                PassManager.parse(pipeline).run(module.operation)
    out.mkdir(parents=True, exist_ok=True)
    if where == "before":
        run()
        print("blockwise_shift_scale ops:", count().get("coreai.blockwise_shift_scale", 0))
    compile_to_binary(module=module, output_directory=out, enable_debug_info=False)
    if where == "after":
        ops = count()
        run()
        print("odix ops changed:", ops != count())
    serialize_module(module=module, path=out / "main-universal.odix")
    print(".odix bytes:", (out / "main-universal.odix").stat().st_size)


# ---------------------------------------------------------------------------------------------
# driver


def child(args: list[str], env: dict | None = None) -> None:
    proc = subprocess.run([sys.executable, __file__, *args], cwd=ROOT, env={**os.environ, **(env or {})},
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        sys.exit(f"error: {args[0]} failed: {proc.stderr[-1500:]}")


def stage(script: str, *args: str) -> None:
    proc = subprocess.run([sys.executable, f"scripts/{script}.py", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        sys.exit(f"error: scripts/{script}.py failed: {proc.stderr[-1500:]}")


def build(work: Path, shape: str, recipes: list[str]) -> dict[str, dict]:
    """The source, export and universal lowering of ``rwkv7-<shape>-shape``, built if missing."""
    conf = work / "config.yaml"
    if not conf.is_file():
        cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
        for name, geometry in SHAPES.items():
            entry = copy.deepcopy(cfg["models"]["rwkv7-1.5b-shape"])
            entry.pop("gate", None)
            entry["dir"] = f"rwkv7_{name.replace('.', '_')}_shape"
            entry["source"]["shape"] = geometry
            entry["description"] = f"Synthetic RWKV-7 of the {name.upper()} geometry (bench/profile_int8_call.py)."
            cfg["models"][f"rwkv7-{name}-shape"] = entry
        conf.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    model = f"rwkv7-{shape}-shape"
    base, c = work / model, ["--config-file", str(conf), "--model", model]
    if not (base / "source" / "manifest.json").is_file():
        stage("source", *c, "--out", str(base / "source"))
    out = {}
    for r in recipes:
        exp, low = base / "export" / r, base / "aot" / r
        if not (exp / "export.json").is_file():
            stage("export", *c, "--recipe", r, "--source", str(base / "source"), "--out", str(exp))
        if not (low / "aot.json").is_file():
            stage("aot", *c, "--recipe", r, "--target", "universal", "--export", str(exp), "--out", str(low))
        record = json.loads((exp / "export.json").read_text())
        aot = json.loads((low / "aot.json").read_text())
        out[r] = {"export_json": exp / "export.json", "aimodel": exp / record["bundle"],
                  "aimodelx": low / aot["product"], "record": record}
    return out


def summary(prof: dict) -> dict:
    ops = prof["last_call_by_op"]
    execute = ops.get("Function Execute", {}).get("seconds", 0.0)
    calls = prof["calls"][1:]
    share = {k[len("call.coreai."):]: round(v["seconds"] / execute, 3) for k, v in ops.items()
             if k.startswith("call.coreai.") and execute}
    return {"wall_s": round(float(np.median([c["wall_s"] for c in calls])), 2),
            "cpu_s": round(float(np.median([c["cpu_s"] for c in calls])), 2),
            "execute_s": round(execute, 2), "share": dict(sorted(share.items(), key=lambda kv: -kv[1])[:6]),
            "blockwise_shift_scale_calls": ops.get("call.coreai.blockwise_shift_scale", {}).get("count", 0),
            "loadavg_1min": round(prof["loadavg"][0], 1)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("profile", "compare", "specialise", "passes"):
        cmd, args = sys.argv[1], sys.argv[2:]
        if cmd == "profile":
            cmd_profile(Path(args[0]), Path(args[1]), int(args[2]), Path(args[3]))
        elif cmd == "passes":
            cmd_passes(Path(args[0]), args[1], args[2], Path(args[3]))
        elif cmd == "compare":
            cmd_compare(Path(args[0]), Path(args[1]), Path(args[2]), int(args[3]), Path(args[4]))
        else:
            cmd_specialise(Path(args[0]), Path(args[1]), Path(args[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["0.1b"], choices=sorted(SHAPES))
    ap.add_argument("--recipes", nargs="+", default=["fp16", "int8keepproj"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/helper-prof-work"))
    ap.add_argument("--calls", type=int, default=2, help="profiled decode calls after one warm-up call")
    ap.add_argument("--steps", type=int, default=8, help="decode tokens the bit-for-bit comparison feeds")
    ap.add_argument("--fast-kernels", action="store_true", help="also profile with COREAI_FAST_KERNELS=1")
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    work = ns.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    results = {"cores": os.cpu_count(), "shapes": {}}
    for shape in ns.shapes:
        built = build(work, shape, ns.recipes)
        rows = results["shapes"][shape] = {}
        for r, b in built.items():
            res = work / "prof" / shape / r
            res.mkdir(parents=True, exist_ok=True)
            child(["profile", str(b["aimodelx"]), str(b["export_json"]), str(ns.calls), str(res / "default.json")])
            row = rows[r] = {"default": summary(json.loads((res / "default.json").read_text())),
                             "quantized_weights": sum(int(np.prod(q["shape"])) for q in b["record"]["quantized"])}
            if ns.fast_kernels:
                child(["profile", str(b["aimodelx"]), str(b["export_json"]), str(ns.calls), str(res / "fast.json")],
                      env={"COREAI_FAST_KERNELS": "1"})
                row["fast_kernels"] = summary(json.loads((res / "fast.json").read_text()))
                row["fast_kernels"]["logits_bit_identical"] = bool(np.array_equal(
                    np.load(res / "default.npy"), np.load(res / "fast.npy")))
            if b["record"]["quantized"]:
                special = res / "specialised" / b["aimodelx"].name
                if not (special / "main-universal.odix").is_file():
                    child(["specialise", str(b["aimodel"]), str(special), str(res / "specialise.json")])
                row["specialise"] = json.loads((res / "specialise.json").read_text())
                child(["compare", str(b["aimodelx"]), str(special), str(b["export_json"]), str(ns.steps),
                       str(res / "compare.json")])
                row["compare"] = json.loads((res / "compare.json").read_text())
                child(["profile", str(special), str(b["export_json"]), str(ns.calls), str(res / "specialised.json")])
                row["specialised"] = summary(json.loads((res / "specialised.json").read_text()))
            row["lowered_odix_bytes"] = (b["aimodelx"] / "main-universal.odix").stat().st_size
            print(f"{shape} {r}: {json.dumps(row)}", flush=True)
    out = ns.json or work / "profile-int8-call.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
