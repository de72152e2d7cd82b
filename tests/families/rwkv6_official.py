"""Run BlinkDL's official rwkv==0.8.32 x060 RNN path on a .pth (its own process: the rwkv package
reads RWKV_V7_ON / RWKV_JIT_ON / RWKV_CUDA_ON at import). Used by tests/families/test_rwkv6_official.py.

usage: python rwkv6_official.py MODEL.pth TOKENS.json OUT.npz
Writes logits [T,V] (one token at a time, state carried) and the final state of every layer:
att_shift [L,C], wkv [L,H,K,V] (rwkv's state[3i+1], k-v orientation), ffn_shift [L,C].
"""
import json
import os
import sys

os.environ.pop("RWKV_V7_ON", None)
os.environ["RWKV_JIT_ON"] = "0"
os.environ["RWKV_CUDA_ON"] = "0"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rwkv.model import RWKV  # noqa: E402


def main(pth: str, tokens_json: str, out: str) -> None:
    torch.set_num_threads(1)
    tokens = json.loads(open(tokens_json).read())
    model = RWKV(model=pth, strategy="cpu fp32", verbose=False)
    assert model.version == 6.0, model.version
    state, logits = None, []
    for t in tokens:
        y, state = model.forward([int(t)], state)
        logits.append(y.float().numpy().copy())
    L = model.args.n_layer
    np.savez(out, logits=np.stack(logits),
             att_shift=np.stack([state[3 * i].float().numpy() for i in range(L)]),
             wkv=np.stack([state[3 * i + 1].float().numpy() for i in range(L)]),
             ffn_shift=np.stack([state[3 * i + 2].float().numpy() for i in range(L)]))


if __name__ == "__main__":
    main(*sys.argv[1:4])
