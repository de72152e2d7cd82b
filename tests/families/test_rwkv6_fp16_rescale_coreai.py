"""RWKV-6 fp16 rescale in the Core AI runtime (issue 21): the deep model with a massive channel of
test_rwkv6_fp16_rescale.py, its fp16 decode function converted (coreai/convert.py: trace,
save_functions), lowered for Linux and run for 12 tokens: without the rescale the bundle overflows
(non-finite logits, NaN states), with it (fp16's default) logits and states match the fp32 reference.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from recurrent_coreai.families.rwkv6 import export_modules as em
from test_rwkv6_fp16_rescale import FAM, G, MASSIVE, STATES, TOKENS, weights

pytest.importorskip("coreai_torch")


def _runtime_logits(dec, tmp_path: Path, tag: str, tokens) -> tuple[np.ndarray, dict]:
    import coreai.runtime as rt

    from recurrent_coreai.coreai.convert import save_functions, trace
    from recurrent_coreai.coreai.entrypoints import DECODE, by_role
    from recurrent_coreai.coreai.runtime import lower_universal

    out = tmp_path / f"{tag}.aimodel"
    # the decode function alone, converted as the export converts it (coreai/convert.py): only main
    # runs here, and the 13-layer prefill's trace would be most of this test's time
    save_functions([trace(by_role(DECODE), FAM, dec, 16, STATES)], out)
    lowered = tmp_path / f"{tag}.aimodelx"
    lowered.mkdir()
    lower_universal(out, lowered)

    async def go():
        model = await rt.AIModel.load(str(lowered))
        main = model.load_function("main")
        states = {s.name: rt.NDArray(np.zeros(s.shape, np.float16)) for s in FAM.state_specs(dec.g)}
        rows = []
        for t in tokens:
            ids = np.array([[t]], np.int32)
            res = await main(inputs={"input_ids": rt.NDArray(ids), "position_ids": rt.NDArray(np.zeros_like(ids))},
                             state=states)
            rows.append(np.asarray(res["logits"].numpy()).reshape(-1).astype(np.float64))
        return np.stack(rows), {n: np.asarray(a.numpy()).astype(np.float64) for n, a in states.items()}

    return asyncio.run(go())


def test_coreai_runtime_fp16_overflows_without_rescale_not_with(tmp_path):
    sd = weights(massive=MASSIVE)
    tokens = TOKENS[:12]
    ref = FAM.reference(sd, G)
    logits, state = ref.run(tokens)
    want = np.stack([row.numpy() for row in logits]).astype(np.float64)
    want_states = ref.bundle_states(state)
    got_off, states_off = _runtime_logits(em.build_decode(sd, G, torch.float16, rescale_every=0), tmp_path, "off", tokens)
    got_on, states_on = _runtime_logits(FAM.build_decode(sd, G, torch.float16), tmp_path, "on", tokens)
    bad = int((~np.isfinite(got_off)).any(1).sum())
    dl = float(np.abs(got_on - want).max())
    top1 = int((got_on.argmax(1) == want.argmax(1)).sum())
    print(f"Core AI runtime fp16, {G.layers} layers, massive {MASSIVE:g}: without rescale {bad}/{len(tokens)} "
          f"non-finite logit rows, NaN states {[int(np.isnan(states_off[n]).sum()) for n in STATES]}; with rescale "
          f"max|dlogits| {dl:.3g}, top-1 {top1}/{len(tokens)}")
    assert bad >= len(tokens) // 2
    assert np.isfinite(got_on).all() and dl < 0.05 and top1 == len(tokens)
    for n in STATES:
        assert np.abs(states_on[n] - want_states[n]).max() / np.abs(want_states[n]).max() < 5e-3, n
