"""What re-running a sample of gate steps at staging would cost (docs/provenance.md): each prompt's
first K decode steps of the stored reference through the bundle's lowering, compared with the rows
of the gate TSV (top-1 exactly, max|dlogits| relative). Prints the time of each part.

    PYTHONPATH=. python bench/gate_sample.py results rwkv7-tiny 4 fp16[,fp32,...]

(the config is the ``config.yaml`` beside ``results``)."""
import sys, time
from pathlib import Path
t_import = time.perf_counter()
import numpy as np
from recurrent_coreai.coreai.runtime import PromptSession
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.pipeline import records, config as cfgmod
from recurrent_coreai.stages import gate, derivation
t_import = time.perf_counter() - t_import
results, model, K = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
cfg = cfgmod.load(results.parent / "config.yaml")
lay = Layout(results, model)
t0 = time.perf_counter()
stream_full = records.read_stream(lay.reference)
t_stream = time.perf_counter() - t0
print(f"imports {t_import:.2f} s; read+check reference stream {t_stream:.2f} s")
for recipe in sys.argv[4].split(","):
    t0 = time.perf_counter()
    g = records.read_gate(lay.gate_json(recipe))
    rows = derivation.tsv_rows(lay.gate_tsv(recipe), records.read_gate_tsv(lay.gate_tsv(recipe), g))
    exp = records.read_export(lay.export(recipe), files=False)
    aot = records.read_aot(lay.aot("universal", recipe))
    st = gate.gate_steps(stream_full, len(g["prompts"]), g["steps"], lay.reference)
    t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    with PromptSession(lay.aot("universal", recipe) / aot["product"], exp) as sess:
        t_load = time.perf_counter() - t0
        t1 = time.perf_counter()
        starts = [int(np.flatnonzero(st["prompt"] == p)[0]) for p in sorted(set(st["prompt"].tolist()))]
        worst, n = 0.0, 0
        for s0 in starts:
            for r in gate.decode_rows(sess, st, g["near_tie_epsilon"], s0, s0 + K):
                t = rows[r["step"]]
                assert r["engine_top1"] == t["engine_top1"], (recipe, r["step"])
                d = abs(r["max_abs_dlogits"] - t["max_abs_dlogits"]) / max(t["max_abs_dlogits"], 1e-30)
                worst = max(worst, d); n += 1
        t_steps = time.perf_counter() - t1
    print(f"{model}/{recipe}: read+parse {t_read:.2f} s, session load {t_load:.2f} s, {n} steps {t_steps:.3f} s; "
          f"worst relative |dlogits| difference vs TSV {worst:.2e}")
