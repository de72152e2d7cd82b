"""The Core AI smoke run any family's test calls: a tiny model exported with both functions (decode
``main`` and a ``chunk``-token ``prefill``) on one converter, lowered to the Linux universal form,
run in the Core AI runtime (one prefill chunk, then decode) and compared with the family's fp32
reference, logits at every call and every state at the end."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import torch


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def export_lower_run(family, g, sd, chunk: int, tmp_path, n_decode: int = 20) -> dict:
    """{d_prefill, d_all, d_state, top1, t_export}, printed on one line; asserts that every state is
    written once per call in both functions."""
    from recurrent_coreai.coreai import convert
    from recurrent_coreai.coreai.entrypoints import ENTRY_POINTS
    from recurrent_coreai.coreai.runtime import lower_universal
    import coreai.runtime as rt

    names = tuple(s.name for s in family.state_specs(g))
    dec = family.build_decode(sd, g, torch.float32)
    t0 = time.perf_counter()
    traced = [convert.trace(e, family, dec, chunk, names) for e in ENTRY_POINTS]
    assert all(t.record["state_writes"] == {n: 1 for n in names} for t in traced)
    aimodel = tmp_path / f"{family.name}.aimodel"
    convert.save_functions(traced, aimodel)
    aimodelx = tmp_path / f"{family.name}.aimodelx"
    aimodelx.mkdir()
    lower_universal(aimodel, aimodelx)
    t_export = time.perf_counter() - t0

    prompt = tokens(chunk + 3, g.vocab, 2)       # one prefill chunk, then decode
    cont = tokens(n_decode, g.vocab, 3)
    ref = family.reference(sd, g)
    state = ref.zero_state()
    want = [ref.step(t, state) for t in prompt + cont]

    async def run():
        model = await rt.AIModel.load(str(aimodelx))
        main, pre = model.load_function("main"), model.load_function("prefill")
        st = {s.name: rt.NDArray(np.zeros(s.shape, np.float32)) for s in family.state_specs(g)}

        async def call(fn, toks):
            ids = np.asarray(toks, np.int32).reshape(1, -1)
            res = await fn(inputs={"input_ids": rt.NDArray(ids), "position_ids": rt.NDArray(np.zeros_like(ids))},
                           state=st)
            return np.asarray(res["logits"].numpy()).reshape(-1)

        out = [await call(pre, prompt[:chunk])]
        for t in prompt[chunk:] + cont:
            out.append(await call(main, [t]))
        return out, {n: np.asarray(a.numpy()).copy() for n, a in st.items()}

    got, states = asyncio.run(run())
    want_after = [want[chunk - 1]] + want[chunk:]
    ref_states = ref.bundle_states(state)
    m = {"d_prefill": float(np.abs(got[0] - want_after[0].numpy()).max()),
         "d_all": max(float(np.abs(a - b.numpy()).max()) for a, b in zip(got, want_after)),
         "d_state": max(float(np.abs(states[n] - ref_states[n]).max()) for n in names),
         "top1": float(np.mean([int(np.argmax(a)) == int(b.argmax()) for a, b in zip(got, want_after)])),
         "t_export": t_export}
    print(f"\nCore AI runtime fp32 vs reference ({family.name}): prefill({chunk}) max|dlogits| {m['d_prefill']:.2e}, "
          f"all {len(got)} calls {m['d_all']:.2e}, states {m['d_state']:.2e}, top-1 {m['top1']:.0%}; "
          f"export+lower {t_export:.1f} s")
    return m
