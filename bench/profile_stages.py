"""Where an export and a gate spend their time, phase by phase, on a built results tree.

    python bench/profile_stages.py RESULTS MODEL RECIPE [--config config.yaml] [--json out.json]

Export (the stage's own code, in this process, into a temporary directory): the checkpoint read and
module build, ``torch.export`` + coreai-torch's decompositions of each entry point (``trace``), the
conversion that writes the bundle (``save``) and the second, decode-only conversion behind
``size_bytes_decode_only`` (``save decode-only``). Gate (the stage's pieces against the tree's
lowering and reference): the runtime session's load, the prefill check, the text stream and the
decode steps of the prompts. Process CPU seconds (``time.process_time``) beside wall seconds, so a
run on a busy machine still shows the split; the imports of torch and coreai, which every stage
process pays once, are timed too. Issue 37's profile (docs/measurements/2026-12-06-profile.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TIMES: dict[str, list[tuple[float, float]]] = {}


@contextmanager
def timed(name: str):
    w0, c0 = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        TIMES.setdefault(name, []).append((time.perf_counter() - w0, time.process_time() - c0))


def wrap(module, attr: str, name: str) -> None:
    original = getattr(module, attr)

    def run(*args, **kwargs):
        with timed(name(*args, **kwargs) if callable(name) else name):
            return original(*args, **kwargs)

    setattr(module, attr, run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("model")
    ap.add_argument("recipe")
    ap.add_argument("--config", default="config.yaml")
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args(argv)
    with timed("imports (torch, coreai-torch, the package)"):
        import recurrent_coreai  # noqa: F401  (numpy's kernels capped first)
        import torch  # noqa: F401
        import coreai_torch  # noqa: F401
        from recurrent_coreai.coreai import convert as cv
        from recurrent_coreai.pipeline import config as cfgmod
        from recurrent_coreai.stages import export, gate
        from recurrent_coreai.stages.gate_lowering import gate_lowering
    wrap(cv, "trace", lambda entry, *a, **k: f"export: trace {entry.name} (torch.export + decompositions)")
    wrap(cv, "save_functions", lambda traced, out, release=False:
         "export: save decode-only" if ".decode-only-" in str(out) else "export: save (to_coreai + write)")
    lay = ns.results / ns.model
    with tempfile.TemporaryDirectory() as tmp, timed("export: the whole stage"):
        rc = export.main(["--config-file", ns.config, "--model", ns.model, "--recipe", ns.recipe, "--source",
                          str(lay / "source"), "--out", f"{tmp}/export", "--log", f"{tmp}/export.log"])
        assert rc in (0, None), rc
    cfg = cfgmod.load(ns.config)
    settings = cfgmod.gate_settings(cfgmod.settings(cfg, "gate", model=ns.model, recipe=ns.recipe), ns.recipe)
    inputs = gate.gate_inputs(ns.model, ns.recipe, lay / "export" / ns.recipe, lay / "aot" / "universal" / ns.recipe,
                              lay / "reference" / "stream.npz", settings, ns.config)
    stream, eps = inputs["stream"], inputs["epsilon"]
    with tempfile.TemporaryDirectory() as tmp, gate_lowering(inputs, Path(tmp) / "g.json") as (lowering, _):
        with timed("gate: runtime session load"):
            sess = gate.PromptSession(lowering, inputs["record"]).__enter__()
        for piece in gate.shard_plan(stream, 1)[0]:
            what = ("gate: the prefill check" if piece.get("prefill") else "gate: the text stream" if piece.get("text")
                    else "gate: the prompts' decode steps")
            with timed(what):
                gate.run_piece(sess, piece, stream, gate.with_epsilon(settings, eps))
    rows = {k: {"calls": len(v), "wall_s": round(sum(w for w, _ in v), 2), "cpu_s": round(sum(c for _, c in v), 2)}
            for k, v in TIMES.items()}
    for k, v in rows.items():
        print(f"{k:55s} {v['calls']:2d} x  wall {v['wall_s']:7.2f} s  cpu {v['cpu_s']:7.2f} s")
    if ns.json:
        ns.json.write_text(json.dumps({"model": ns.model, "recipe": ns.recipe, "phases": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
