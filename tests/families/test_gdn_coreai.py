"""Core AI smoke test: a tiny Gated DeltaNet (GVA: 4 value heads over 2 q/k heads, expand_v 2,
negative eigenvalues allowed) exported with both functions (decode ``main`` and a 16-token
``prefill``) on one converter, lowered to the Linux universal form, run in the Core AI runtime and
compared with the reference (fp32)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from recurrent_coreai import families

pytest.importorskip("coreai_torch")
FAMILY = families.get("gdn")
CHUNK = 16
TOL = 1e-3


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_export_lower_run_matches_reference(tmp_path):
    from recurrent_coreai.coreai import convert
    from recurrent_coreai.coreai.entrypoints import ENTRY_POINTS
    from recurrent_coreai.coreai.runtime import lower_universal
    import coreai.runtime as rt

    g = FAMILY.geometry_from_shape(FAMILY.tiny_shape, "smoke")
    sd = dict(FAMILY.synthetic_tensors(g, 11))
    dec = FAMILY.build_decode(sd, g, torch.float32)
    names = tuple(s.name for s in FAMILY.state_specs(g))
    t0 = time.perf_counter()
    traced = [convert.trace(e, FAMILY, dec, CHUNK, names) for e in ENTRY_POINTS]
    assert all(t.record["state_writes"] == {n: 1 for n in names} for t in traced)
    aimodel = tmp_path / "gdn.aimodel"
    convert.save_functions(traced, aimodel)
    aimodelx = tmp_path / "gdn.aimodelx"
    aimodelx.mkdir()
    lower_universal(aimodel, aimodelx)
    t_export = time.perf_counter() - t0

    prompt = _tokens(CHUNK + 3, g.vocab, 2)       # one prefill chunk, then decode
    cont = _tokens(20, g.vocab, 3)
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
    d_state = max(float(np.abs(states[n] - ref_states[n]).max()) for n in names)
    top1 = np.mean([int(np.argmax(a)) == int(b.argmax()) for a, b in zip(got, want_after)])
    print(f"\nCore AI runtime fp32 vs reference: prefill({CHUNK}) max|dlogits| {d_prefill:.2e}, "
          f"all {len(got)} calls {d_all:.2e}, states {d_state:.2e}, top-1 {top1:.0%}; export+lower {t_export:.1f} s")
    assert d_all < TOL and d_state < TOL and top1 == 1.0
