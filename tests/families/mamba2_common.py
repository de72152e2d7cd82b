"""Shared pieces of the Mamba-2 family tests: tiny geometries, weights, token streams."""

from __future__ import annotations

import torch

from recurrent_coreai.families import get

FAMILY = get("mamba2")

# (name, config.yaml shape): one group and K=4; four groups, K=3, other head/state sizes, tied head
SHAPES = {
    "g1": {"layers": 2, "hidden": 64, "d_state": 16, "headdim": 16, "vocab": 256},
    "g4-tied": {"layers": 3, "hidden": 48, "d_state": 24, "headdim": 12, "vocab": 300, "n_groups": 4,
                "conv_kernel": 3, "tie_embeddings": True},
}


def geometry(name: str):
    return FAMILY.geometry_from_shape(SHAPES[name], f"shape {name}")


def weights(geom, seed: int = 0) -> dict[str, torch.Tensor]:
    return dict(FAMILY.synthetic_tensors(geom, seed))


def tokens(n: int, vocab: int, seed: int = 1) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_steps(dec, toks) -> torch.Tensor:
    """Logits [T, V] of the decode module fed one token at a time (its states persist)."""
    out = []
    with torch.no_grad():
        for t in toks:
            out.append(dec(torch.tensor([[t]], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32))[0, 0])
    return torch.stack(out)


def prefill(dec, toks) -> torch.Tensor:
    T = len(toks)
    pre = FAMILY.build_prefill(dec, T)
    with torch.no_grad():
        return pre(torch.tensor([toks], dtype=torch.int32), torch.arange(T, dtype=torch.int32).reshape(1, T))[0, 0]
