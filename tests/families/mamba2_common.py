"""Shared pieces of the Mamba-2 family tests: tiny geometries, weights, token streams."""

from __future__ import annotations

import torch

from ssm_common import decode_steps, prefill_with, tokens  # noqa: F401 - the family tests import these from here
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


def prefill(dec, toks) -> torch.Tensor:
    return prefill_with(FAMILY.build_prefill, dec, toks)
