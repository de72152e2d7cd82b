"""Core AI smoke test: a tiny Mamba-2 (two groups) exported with both functions (decode ``main``
and a 16-token ``prefill``) on one converter, lowered to the Linux universal form, run in the
Core AI runtime and compared with the reference (fp32)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from mamba2_common import FAMILY, tokens, weights
from recurrent_coreai.families.mamba2.export_modules import STATE_NAMES

pytest.importorskip("coreai_torch")
CHUNK = 16
TOL = 1e-3


def test_export_lower_run_matches_reference(tmp_path):
    from recurrent_coreai.coreai import convert
    from recurrent_coreai.coreai.entrypoints import ENTRY_POINTS
    from recurrent_coreai.coreai.runtime import lower_universal
    import coreai.runtime as rt

    g = FAMILY.geometry_from_shape({"layers": 2, "hidden": 64, "d_state": 16, "headdim": 16, "vocab": 256,
                                    "n_groups": 2}, "smoke")
    sd = weights(g, seed=11)
    dec = FAMILY.build_decode(sd, g, torch.float32)
    t0 = time.perf_counter()
    traced = [convert.trace(e, FAMILY, dec, CHUNK, STATE_NAMES) for e in ENTRY_POINTS]
    assert all(t.record["state_writes"] == {"convState": 1, "ssmState": 1} for t in traced)
    aimodel = tmp_path / "m2.aimodel"
    convert.save_functions(traced, aimodel)
    aimodelx = tmp_path / "m2.aimodelx"
    aimodelx.mkdir()
    lower_universal(aimodel, aimodelx)
    t_export = time.perf_counter() - t0

    prompt = tokens(CHUNK + 3, g.vocab, seed=2)       # one prefill chunk, then decode
    cont = tokens(20, g.vocab, seed=3)
    ref = FAMILY.reference(sd, g)
    state = ref.zero_state()
    want = [ref.step(t, state) for t in prompt + cont]

    async def run():
        model = await rt.AIModel.load(str(aimodelx))
        main, pre = model.load_function("main"), model.load_function("prefill")
        st = {s.name: rt.NDArray(np.zeros(s.shape, np.float32)) for s in FAMILY.state_specs(g)}

        async def call(fn, toks):
            ids = np.asarray(toks, np.int32).reshape(1, -1)
            res = await fn(inputs={"input_ids": rt.NDArray(ids), "position_ids": rt.NDArray(np.zeros_like(ids))},
                           state=st)
            return np.asarray(res["logits"].numpy()).reshape(-1)

        out = [await call(pre, prompt[:CHUNK])]
        for t in prompt[CHUNK:] + cont:
            out.append(await call(main, [t]))
        return out, {n: np.asarray(a.numpy()).copy() for n, a in st.items()}

    got, states = asyncio.run(run())
    want_after = [want[CHUNK - 1]] + want[CHUNK:]
    d_prefill = float(np.abs(got[0] - want_after[0].numpy()).max())
    d_all = max(float(np.abs(a - b.numpy()).max()) for a, b in zip(got, want_after))
    ref_states = ref.bundle_states(state)
    d_state = max(float(np.abs(states[n] - ref_states[n]).max()) for n in STATE_NAMES)
    top1 = np.mean([int(np.argmax(a)) == int(b.argmax()) for a, b in zip(got, want_after)])
    print(f"\nCore AI runtime fp32 vs reference: prefill({CHUNK}) max|dlogits| {d_prefill:.2e}, "
          f"all {len(got)} calls {d_all:.2e}, states {d_state:.2e}, top-1 {top1:.0%}; export+lower {t_export:.1f} s")
    assert d_all < TOL and d_state < TOL and top1 == 1.0
