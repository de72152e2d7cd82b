"""Core AI smoke test for RWKV-6: a tiny synthetic model's decode and prefill functions exported
into ONE .aimodel with coreai-torch (coreai/convert.py, the pipeline's own conversion), lowered
for Linux (runtime.lower_universal), and run in the Core AI runtime on shared states: a prompt
of 2 prefill chunks then decode steps, against the fp32 reference (max|dlogits| < 1e-3, states
< 1e-3). fp16 is measured too (printed, loose bound: fp16 weights and states).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from recurrent_coreai.coreai.convert import convert
from recurrent_coreai.coreai.runtime import lower_universal
from recurrent_coreai.families import get
from recurrent_coreai.families.rwkv6.geometry import Geometry

FAM = get("rwkv6")
G = Geometry(layers=2, hidden=128, ffn=448, vocab=512, mix_lora=16, decay_lora=32)
CHUNK = 16
N_DECODE = 24
TOKENS = torch.randint(0, G.vocab, (2 * CHUNK + N_DECODE,), generator=torch.Generator().manual_seed(4)).tolist()


def run_bundle(aimodelx: Path, dtype: np.dtype, state_shapes: dict) -> tuple[list[np.ndarray], dict]:
    import coreai.runtime as rt

    async def go():
        model = await rt.AIModel.load(str(aimodelx))
        main, prefill = model.load_function("main"), model.load_function("prefill")
        states = {n: rt.NDArray(np.zeros(s, dtype)) for n, s in state_shapes.items()}

        async def call(fn, ids):
            ids = np.asarray(ids, np.int32).reshape(1, -1)
            res = await fn(inputs={"input_ids": rt.NDArray(ids), "position_ids": rt.NDArray(np.zeros_like(ids))},
                           state=states)
            return np.asarray(res["logits"].numpy()).reshape(-1).astype(np.float64)

        out = [await call(prefill, TOKENS[c * CHUNK:(c + 1) * CHUNK]) for c in range(2)]
        out += [await call(main, [t]) for t in TOKENS[2 * CHUNK:]]
        return out, {n: np.asarray(a.numpy()).astype(np.float64) for n, a in states.items()}

    return asyncio.run(go())


@pytest.fixture(scope="module")
def reference_run():
    sd = dict(FAM.synthetic_tensors(G, 13))
    ref = FAM.reference(sd, G)
    logits, state = ref.run(TOKENS)
    want = [logits[CHUNK - 1], logits[2 * CHUNK - 1]] + [logits[i] for i in range(2 * CHUNK, len(TOKENS))]
    return sd, [w.numpy().astype(np.float64) for w in want], ref.bundle_states(state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_coreai_runtime_matches_reference(reference_run, dtype, tmp_path):
    sd, want, want_states = reference_run
    states = tuple(s.name for s in FAM.state_specs(G))
    dec = FAM.build_decode(sd, G, dtype)
    out = tmp_path / "rwkv6.aimodel"
    record = convert(FAM, dec, out, CHUNK, states, decode_only=False)
    for name, f in record["functions"].items():
        assert f["state_writes"] == {n: 1 for n in states}, name
    lowered = tmp_path / "rwkv6.aimodelx"
    lowered.mkdir()
    lower_universal(out, lowered)
    np_dtype = np.float32 if dtype == torch.float32 else np.float16
    got, got_states = run_bundle(lowered, np_dtype, {s.name: s.shape for s in FAM.state_specs(G)})
    dl = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
    top1 = sum(int(np.argmax(g) == np.argmax(w)) for g, w in zip(got, want))
    ds = {n: float(np.abs(got_states[n] - want_states[n]).max()) for n in states}
    print(f"Core AI runtime {dtype} vs reference (2 prefill chunks of {CHUNK} + {N_DECODE} decode steps): "
          f"max|dlogits| {dl:.3g}, top-1 {top1}/{len(want)}, states {ds}")
    if dtype == torch.float32:
        assert dl < 1e-3 and all(v < 1e-3 for v in ds.values())
    else:
        assert dl < 0.5 and top1 >= len(want) - 2
