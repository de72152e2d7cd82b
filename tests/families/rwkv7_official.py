"""Run BlinkDL's official rwkv==0.8.32 x070 RNN path on a .pth (its own process: the rwkv package
reads RWKV_V7_ON / RWKV_JIT_ON / RWKV_CUDA_ON at import; x060 needs RWKV_V7_ON unset). Used by
tests/families/test_official_constants.py and test_trained_fixtures_official.py.

usage: python rwkv7_official.py MODEL (without .pth: RWKV_x070 appends it) TOKENS.json OUT.npz
Writes logits [T,V] (one token at a time, state carried) and wkv [L,H,K,V], the final matrix state
of every layer (rwkv's state[3i+1] is [H,V,K]: transposed here).
"""
import json
import os
import subprocess
import sys
from pathlib import Path


def main(model_path: str, tokens_json: str, out: str) -> None:
    os.environ["RWKV_V7_ON"] = "1"
    os.environ["RWKV_JIT_ON"] = "0"
    os.environ["RWKV_CUDA_ON"] = "0"
    import numpy as np
    import torch
    from rwkv.model import RWKV

    torch.set_num_threads(1)
    model = RWKV(model=model_path, strategy="cpu fp32")
    assert type(model).__name__ == "RWKV_x070", type(model).__name__
    state, logits = None, []
    for t in json.loads(open(tokens_json).read()):
        y, state = model.forward([int(t)], state)
        logits.append(y.detach().float().numpy().copy())
    layers = len(state) // 3
    np.savez(out, logits=np.stack(logits),
             wkv=np.stack([state[3 * i + 1].float().numpy().transpose(0, 2, 1) for i in range(layers)]))


def run_official(pth: Path, tokens: list[int], tmp: Path) -> dict:
    """{logits, wkv} of the official x070 on ``pth`` fed ``tokens`` one at a time (a fresh interpreter)."""
    import numpy as np

    (tmp / "tokens.json").write_text(json.dumps([int(t) for t in tokens]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RWKV_")}
    env["OMP_NUM_THREADS"] = "1"
    model = str(pth)[: -len(".pth")] if str(pth).endswith(".pth") else str(pth)
    res = subprocess.run([sys.executable, __file__, model, str(tmp / "tokens.json"), str(tmp / "official.npz")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"rwkv x070 worker failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return dict(np.load(tmp / "official.npz"))


if __name__ == "__main__":
    main(*sys.argv[1:4])
