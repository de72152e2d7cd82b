"""Seeded, deterministic random Gated DeltaNet weights in the normal form.

The family-wide draw policy (families/draws.py: one generator, float64 draws) gives every tensor in :func:`.geometry.normal_shapes` order (same seed and geometry:
the same bytes). Ranges follow fla's own init where it matters for the recurrence: ``A_log =
log(U[1, 16])``, ``dt_bias = softplus⁻¹(dt)`` with dt log-uniform in [1e-3, 1e-1] (so the decay
exp(g) spans slow and fast heads), short-conv taps U[-1/√K, 1/√K] (nn.Conv1d's bound), linears
N(0, 1/in). Norm weights are 1 plus a little noise (a mix-up between norms shows); the b_proj rows
are hotter (std 2/√C) so that beta spreads over (0, 1) rather than sitting at 0.5. The lm_head is
hotter than 1/√C with a log-normal spread of row norms, as for the other families: peaked logits,
so teacher-forced top-1 comparisons mean something. A tied geometry's head is the embedding.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from recurrent_coreai.families.draws import Draws
from recurrent_coreai.families.gdn.geometry import Geometry, normal_shapes

LM_HEAD_GAIN = 3.0
LM_HEAD_ROW_SPREAD = 0.4
DT_MIN, DT_MAX = 1e-3, 1e-1
A_RANGE = (1.0, 16.0)


def _head(shape, g: Geometry, d: Draws) -> torch.Tensor:
    rows = torch.exp(d.normal((shape[0], 1), LM_HEAD_ROW_SPREAD, exact=True))
    return (d.normal(shape, LM_HEAD_GAIN / math.sqrt(g.hidden), exact=True) * rows).float()


def _init(name: str, shape: tuple[int, ...], g: Geometry, d: Draws) -> torch.Tensor:
    if name == "model.embeddings.weight":
        return _head(shape, g, d) if g.tie_embeddings else d.normal(shape, 1.0)
    if name == "lm_head.weight":
        return _head(shape, g, d)
    if name.endswith("norm.weight"):
        return d.uniform(shape, 0.8, 1.2)
    if name.endswith("conv1d.weight"):
        bound = 1.0 / math.sqrt(shape[-1])
        return d.uniform(shape, -bound, bound)
    if name.endswith("attn.A_log"):
        return torch.log(d.uniform(shape, *A_RANGE, exact=True)).float()
    if name.endswith("attn.dt_bias"):
        dt = d.log_uniform(shape, DT_MIN, DT_MAX, exact=True)
        return (dt + torch.log(-torch.expm1(-dt))).float()   # softplus⁻¹
    if name.endswith("attn.b_proj.weight"):
        return d.normal(shape, 2.0 / math.sqrt(shape[1]))
    if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
        return d.normal(shape, 0.5 / math.sqrt(shape[1]))
    if name.endswith("_proj.weight"):
        return d.normal(shape, 1.0 / math.sqrt(shape[1]))
    raise KeyError(name)


def synthetic_tensors(g: Geometry, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    d = Draws(seed)
    emb = None
    for name, shape in normal_shapes(g).items():
        if name == "lm_head.weight" and g.tie_embeddings:
            yield name, emb.clone()
            continue
        t = _init(name, shape, g, d).contiguous()
        if name == "model.embeddings.weight":
            emb = t
        yield name, t
