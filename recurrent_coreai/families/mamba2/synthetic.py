"""Seeded, deterministic random Mamba-2 weights in the normal form.

One generator draws every tensor in :func:`.geometry.normal_shapes` order (same seed and geometry:
the same bytes). Ranges follow mamba_ssm's own init where it matters for the recurrence:
``A_log = log(U[1, 16])``; ``dt_bias = softplus⁻¹(dt)`` with dt log-uniform in [1e-3, 1e-1], so
``softplus(dt_in + dt_bias)`` stays around 1e-3..1e-1 for the in_proj's dt rows; D around 1.
Norm weights are 1 plus a little noise (a mix-up between norms shows). The lm_head is hotter
than 1/sqrt(C) with a log-normal spread of row norms (the idea of families/rwkv7/synthetic.py):
the logits are peaked, so teacher-forced top-1 comparisons mean something. A tied geometry's
lm_head is the embedding itself (drawn with the lm_head's recipe).
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from recurrent_coreai.families.mamba2.geometry import Geometry, normal_shapes

LM_HEAD_GAIN = 3.0        # base logit std (norm_f output has unit RMS)
LM_HEAD_ROW_SPREAD = 0.4  # log-normal spread of lm_head row norms
DT_MIN, DT_MAX = 1e-3, 1e-1
A_RANGE = (1.0, 16.0)


def _normal(shape, std: float, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * std).float()


def _uniform(shape, lo: float, hi: float, gen: torch.Generator) -> torch.Tensor:
    return (torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo).float()


def _head(shape, g: Geometry, gen: torch.Generator) -> torch.Tensor:
    rows = torch.exp(torch.randn((shape[0], 1), generator=gen, dtype=torch.float64) * LM_HEAD_ROW_SPREAD)
    w = torch.randn(shape, generator=gen, dtype=torch.float64) * (LM_HEAD_GAIN / math.sqrt(g.hidden))
    return (w * rows).float()


def _init(name: str, shape: tuple[int, ...], g: Geometry, gen: torch.Generator) -> torch.Tensor:
    if name == "backbone.embeddings.weight":
        return _head(shape, g, gen) if g.tie_embeddings else _normal(shape, 1.0, gen)
    if name == "lm_head.weight":
        return _head(shape, g, gen)
    if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
        return _uniform(shape, 0.8, 1.2, gen)
    if name.endswith("mixer.in_proj.weight"):
        return _normal(shape, 1.0 / math.sqrt(shape[1]), gen)
    if name.endswith("mixer.conv1d.weight"):
        bound = 1.0 / math.sqrt(shape[-1])
        return _uniform(shape, -bound, bound, gen)
    if name.endswith("mixer.conv1d.bias"):
        return _uniform(shape, -0.1, 0.1, gen)
    if name.endswith("mixer.dt_bias"):
        dt = torch.exp(torch.rand(shape, generator=gen, dtype=torch.float64) * (math.log(DT_MAX) - math.log(DT_MIN))
                       + math.log(DT_MIN))
        return (dt + torch.log(-torch.expm1(-dt))).float()   # softplus⁻¹
    if name.endswith("mixer.A_log"):
        return torch.log(torch.rand(shape, generator=gen, dtype=torch.float64) * (A_RANGE[1] - A_RANGE[0])
                         + A_RANGE[0]).float()
    if name.endswith("mixer.D"):
        return _uniform(shape, 0.5, 1.5, gen)
    if name.endswith("mixer.out_proj.weight"):
        return _normal(shape, 0.5 / math.sqrt(shape[1]), gen)
    raise KeyError(name)


def synthetic_tensors(g: Geometry, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(int(seed))
    emb = None
    for name, shape in normal_shapes(g).items():
        if name == "lm_head.weight" and g.tie_embeddings:
            yield name, emb.clone()
            continue
        t = _init(name, shape, g, gen).contiguous()
        if name == "backbone.embeddings.weight" and g.tie_embeddings:
            emb = t
        yield name, t


def synthetic_state_dict(g: Geometry, seed: int) -> dict[str, torch.Tensor]:
    return dict(synthetic_tensors(g, seed))
