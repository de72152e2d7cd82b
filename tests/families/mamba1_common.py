"""Shared pieces of the Mamba-1 family tests: tiny geometries (plain and Falcon Mamba), weights,
token streams."""

from __future__ import annotations

import torch

from ssm_common import decode_steps, prefill_with, tokens  # noqa: F401 - the family tests import these from here
from recurrent_coreai.families import get

FAMILY = get("mamba1")

# (name, config.yaml shape): tied head and dt_rank "auto" (ceil(48/16) = 3); an explicit dt_rank, an
# untied head, K=3 and expand 3; Falcon Mamba (B/C/Δ norms) untied with its own eps values
SHAPES = {
    "tied-auto": {"layers": 2, "hidden": 48, "d_state": 8, "vocab": 256, "tie_embeddings": True},
    "untied-rank": {"layers": 3, "hidden": 32, "d_state": 12, "vocab": 300, "dt_rank": 7, "conv_kernel": 3,
                    "expand": 3},
    "falcon": {"layers": 2, "hidden": 64, "d_state": 16, "vocab": 256, "dt_rank": 6, "falcon": True,
               "mixer_eps": 1e-5, "norm_eps": 1e-6},
}


def geometry(name: str):
    return FAMILY.geometry_from_shape(SHAPES[name], f"shape {name}")


def weights(geom, seed: int = 0) -> dict[str, torch.Tensor]:
    return dict(FAMILY.synthetic_tensors(geom, seed))


def prefill(dec, toks) -> torch.Tensor:
    return prefill_with(FAMILY.build_prefill, dec, toks)
