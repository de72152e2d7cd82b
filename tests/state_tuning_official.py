"""Run BlinkDL's official rwkv==0.8.32 RNN path from a state-tuning file's initial state (its own
process: the package reads RWKV_V7_ON / RWKV_JIT_ON / RWKV_CUDA_ON at import). Used by
tests/test_state_tuning.py.

usage: python state_tuning_official.py x060|x070 MODEL.pth STATE.pth TOKENS.json OUT.npz

x060: the state file's ``blocks.<i>.att.time_state`` are merged into the model's weights, which the
package's RWKV-6 loader reads itself (``args.time_state``: ``state[3i+1] = time_state.transpose(1,2)``).
x070: the package's ``RWKV_x070`` has no loader for them; its ``state[3i+1]`` ([H, V, K]: ``v k^T`` is
added each token) is set to the time_state as it is -- the orientation of the trainers' wkv kernels,
which RWKV-PEFT's and RWKV-Runner's loaders keep. Writes logits [T, V], one token at a time.
"""
import json
import os
import sys


def main(version: str, model_pth: str, state_pth: str, tokens_json: str, out: str) -> None:
    os.environ["RWKV_JIT_ON"] = "0"
    os.environ["RWKV_CUDA_ON"] = "0"
    if version == "x070":
        os.environ["RWKV_V7_ON"] = "1"
    else:
        os.environ.pop("RWKV_V7_ON", None)
    import numpy as np
    import torch
    from rwkv.model import RWKV

    torch.set_num_threads(1)
    tuned = torch.load(state_pth, map_location="cpu", weights_only=True)
    tokens = json.loads(open(tokens_json).read())
    if version == "x060":
        weights = torch.load(model_pth, map_location="cpu", weights_only=True)
        weights.update(tuned)
        merged = out + ".merged.pth"
        torch.save(weights, merged)
        model = RWKV(model=merged, strategy="cpu fp32", verbose=False)
        assert model.version == 6.0 and model.args.time_state, model.version
        state = None  # the loader's own: time_state.transpose(1,2) per layer
    else:
        model = RWKV(model=model_pth[: -len(".pth")], strategy="cpu fp32")
        assert type(model).__name__ == "RWKV_x070", type(model).__name__
        state = model.generate_zero_state()
        for i in range(len(state) // 3):
            state[3 * i + 1] = tuned[f"blocks.{i}.att.time_state"].float().clone()
    logits = []
    for t in tokens:
        y, state = model.forward([int(t)], state)
        logits.append(y.detach().float().numpy().copy())
    np.savez(out, logits=np.stack(logits))


if __name__ == "__main__":
    main(*sys.argv[1:6])
