"""What the Mamba-1 and Mamba-2 family tests share (their families share families/ssm.py): token
streams, feeding a decode or prefill module, reading its states, transformers' logits and cache
states over a stream, and the reference's distance from them; a copy of a reference module with
one term broken."""

from __future__ import annotations

import inspect
import types

import numpy as np
import torch

from recurrent_coreai.families.ssm import STATE_NAMES


def tokens(n: int, vocab: int, seed: int = 1) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_steps(dec, toks) -> torch.Tensor:
    """Logits [T, V] of the decode module fed one token at a time (its states persist)."""
    out = []
    with torch.no_grad():
        for t in toks:
            out.append(dec(torch.tensor([[t]], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32))[0, 0])
    return torch.stack(out)


def prefill_with(build_prefill, dec, toks) -> torch.Tensor:
    """The last position's logits of one prefill call over ``toks`` (the family's build_prefill)."""
    T = len(toks)
    pre = build_prefill(dec, T)
    with torch.no_grad():
        return pre(torch.tensor([toks], dtype=torch.int32), torch.arange(T, dtype=torch.int32).reshape(1, T))[0, 0]


def states(dec) -> dict[str, np.ndarray]:
    return {n: getattr(dec, n).detach().numpy().copy() for n in STATE_NAMES}


def max_state_delta(a: dict, b: dict) -> float:
    return max(float(np.abs(a[n] - b[n]).max()) for n in STATE_NAMES)


def hf_run(model, toks, layers: int) -> dict:
    """transformers' logits over ``toks`` (the whole sequence in one forward, and one token at a
    time through its cache) and both states after the last token, in the bundle's layout."""
    ids = torch.tensor([toks])
    with torch.no_grad():
        full = model(ids, use_cache=True)
        cache, logits_step = None, []
        for t in toks:
            o = model(torch.tensor([[t]]), cache=cache, use_cache=True)
            cache = o.cache
            logits_step.append(o.logits[0, -1])

    def cache_states(c):
        return {"convState": torch.stack([c.get_conv_state(i) for i in range(layers)]).numpy(),
                "ssmState": torch.stack([c.get_recurrent_state(i) for i in range(layers)]).numpy()}

    return {"full": full.logits[0], "step": torch.stack(logits_step), "states_full": cache_states(full.cache),
            "states_step": cache_states(cache)}


def max_abs(a, b) -> float:
    """max |a - b|; inf when either holds a NaN or inf (a diverged copy must count as far off)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max()) if np.isfinite(a).all() and np.isfinite(b).all() else float("inf")


def deltas(ref, toks, hf) -> dict[str, float]:
    """The reference's logits and final states against :func:`hf_run`'s, each as max |a - b|."""
    logits, state = ref.run(toks)
    got = ref.bundle_states(state)
    out = {"logits_full": max_abs(logits, hf["full"]), "logits_step": max_abs(logits, hf["step"])}
    for kind in ("full", "step"):
        for name in STATE_NAMES:
            assert got[name].shape == hf[f"states_{kind}"][name].shape
            out[f"{name}_{kind}"] = max_abs(got[name], hf[f"states_{kind}"][name])
    return out


def broken_reference(module, old: str, new: str):
    """The Reference class of a copy of ``module`` (a family's reference.py) with ``old`` replaced
    by ``new``; ``old`` must occur once."""
    src = inspect.getsource(module)
    assert src.count(old) == 1, f"the reference changed: {old!r} occurs {src.count(old)} times"
    name = "broken_" + module.__name__.rsplit(".", 2)[-2] + "_reference"
    mod = types.ModuleType(name)
    exec(compile(src.replace(old, new), name, "exec"), mod.__dict__)
    return mod.Reference
