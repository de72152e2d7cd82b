"""Measure: the Mamba-2 prefill function at several chunk lengths and dtypes through Core AI
(export, lower, run) against the fp64 reference. Not a test (minutes at 256); prints one line per run.

    OMP_NUM_THREADS=1 .venv/bin/python tests/families/mamba2_coreai_chunks.py 64 256
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from mamba2_common import FAMILY, tokens, weights  # noqa: E402
from recurrent_coreai.coreai import convert  # noqa: E402
from recurrent_coreai.coreai.entrypoints import ENTRY_POINTS  # noqa: E402
from recurrent_coreai.coreai.runtime import lower_universal  # noqa: E402
from recurrent_coreai.families.mamba2.export_modules import STATE_NAMES  # noqa: E402


def measure(chunk: int, dtype: torch.dtype) -> str:
    import coreai.runtime as rt

    g = FAMILY.geometry_from_shape({"layers": 2, "hidden": 64, "d_state": 16, "headdim": 16, "vocab": 256,
                                    "n_groups": 2}, "m")
    sd = weights(g, seed=11)
    dec = FAMILY.build_decode(sd, g, dtype)
    tmp = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    traced = [convert.trace(e, FAMILY, dec, chunk, STATE_NAMES) for e in ENTRY_POINTS]
    convert.save_functions(traced, tmp / "m.aimodel")
    (tmp / "m.aimodelx").mkdir()
    lower_universal(tmp / "m.aimodel", tmp / "m.aimodelx")
    t_conv = time.perf_counter() - t0
    toks = tokens(chunk + 8, g.vocab, seed=chunk)
    ref = FAMILY.reference(sd, g, torch.float64)
    state = ref.zero_state()
    want = [ref.step(t, state).numpy() for t in toks]
    npd = np.float32 if dtype == torch.float32 else np.float16

    async def run():
        model = await rt.AIModel.load(str(tmp / "m.aimodelx"))
        main, pre = model.load_function("main"), model.load_function("prefill")
        st = {s.name: rt.NDArray(np.zeros(s.shape, npd)) for s in FAMILY.state_specs(g)}

        async def call(fn, ids):
            ids = np.asarray(ids, np.int32).reshape(1, -1)
            res = await fn(inputs={"input_ids": rt.NDArray(ids), "position_ids": rt.NDArray(np.zeros_like(ids))},
                           state=st)
            return np.asarray(res["logits"].numpy()).reshape(-1).astype(np.float64)

        t1 = time.perf_counter()
        out = [await call(pre, toks[:chunk])]
        t_pre = time.perf_counter() - t1
        for t in toks[chunk:]:
            out.append(await call(main, [t]))
        return out, t_pre

    got, t_pre = asyncio.run(run())
    ref_rows = [want[chunk - 1]] + want[chunk:]
    d = max(float(np.abs(a - b).max()) for a, b in zip(got, ref_rows))
    top1 = np.mean([a.argmax() == b.argmax() for a, b in zip(got, ref_rows)])
    return (f"chunk {chunk} {str(dtype).removeprefix('torch.')}: max|dlogits| vs fp64 reference {d:.2e} over "
            f"{len(got)} calls (prefill + 8 decode), top-1 {top1:.0%}; export+lower {t_conv:.1f} s, "
            f"prefill call {t_pre:.2f} s")


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["64"]:
        for dt in (torch.float32, torch.float16):
            print(measure(int(arg), dt), flush=True)
