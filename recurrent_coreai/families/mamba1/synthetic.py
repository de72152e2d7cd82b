"""Seeded, deterministic random Mamba-1 weights in the normal form.

One generator draws every tensor in :func:`.geometry.normal_shapes` order (same seed and geometry:
the same bytes), by the policy of :mod:`recurrent_coreai.families.draws`. Ranges follow mamba_ssm's
own init where it matters for the recurrence: ``A_log[i, n] = log(U[1, 16])`` (S4D-real puts
log(n + 1) there; a draw keeps the channels apart); ``dt_proj.bias = softplus⁻¹(dt)`` with dt
log-uniform in [1e-3, 1e-1] and ``dt_proj.weight`` U(±R^-1/2), so Δ stays around 1e-3..1e-1 plus
what the rank-R projection adds; D around 1. Norm weights are 1 plus a little noise (a mix-up
between norms shows). The lm_head is hotter than 1/sqrt(C) with a log-normal spread of row norms
(the idea of families/rwkv7/synthetic.py): the logits are peaked, so teacher-forced top-1
comparisons mean something. A tied geometry's lm_head is the embedding itself (drawn with the
lm_head's recipe).
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from recurrent_coreai.families.draws import RANDN_CHUNK, Draws
from recurrent_coreai.families.mamba1.geometry import Geometry, normal_shapes

LM_HEAD_GAIN = 3.0        # base logit std (norm_f output has unit RMS)
LM_HEAD_ROW_SPREAD = 0.4  # log-normal spread of lm_head row norms
DT_MIN, DT_MAX = 1e-3, 1e-1
A_RANGE = (1.0, 16.0)


def _head(shape, g: Geometry, d: Draws) -> torch.Tensor:
    """``(d.normal(shape, gain, exact=True) * rows).float()`` with ``rows = exp(d.normal((V, 1),
    spread, exact=True))``, the same values, made RANDN_CHUNK values at a time: never a float64
    table (a 50288 x 2048 head would be two 824 MB float64 temporaries beside its 412 MB). The
    draws are calls of RANDN_CHUNK values, then one of the rest (families/draws.py: what one call
    draws); each value is multiplied by its row's factor in float64 and cast once, as the whole."""
    rows = torch.exp(d.normal((shape[0], 1), LM_HEAD_ROW_SPREAD, exact=True)).reshape(-1)
    out = torch.empty(tuple(shape), dtype=torch.float32)
    flat, at, width = out.view(-1), 0, shape[1]
    while at < flat.numel():
        n = flat.numel() - at if flat.numel() - at < 2 * RANDN_CHUNK else RANDN_CHUNK
        w = d.normal((n,), LM_HEAD_GAIN / math.sqrt(g.hidden), exact=True)
        flat[at:at + n] = w.mul_(rows[torch.arange(at, at + n) // width])  # the one cast, as (w * rows).float()
        at += n
    return out


def _init(name: str, shape: tuple[int, ...], g: Geometry, d: Draws) -> torch.Tensor:
    if name == "backbone.embeddings.weight":
        return _head(shape, g, d) if g.tie_embeddings else d.normal(shape, 1.0)
    if name == "lm_head.weight":
        return _head(shape, g, d)
    if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
        return d.uniform(shape, 0.8, 1.2)
    if name.endswith("mixer.in_proj.weight") or name.endswith("mixer.x_proj.weight"):
        return d.normal(shape, 1.0 / math.sqrt(shape[1]))
    if name.endswith("mixer.conv1d.weight"):
        bound = 1.0 / math.sqrt(shape[-1])
        return d.uniform(shape, -bound, bound)
    if name.endswith("mixer.conv1d.bias"):
        return d.uniform(shape, -0.1, 0.1)
    if name.endswith("mixer.dt_proj.weight"):
        bound = 1.0 / math.sqrt(shape[1])
        return d.uniform(shape, -bound, bound)
    if name.endswith("mixer.dt_proj.bias"):
        dt = d.log_uniform(shape, DT_MIN, DT_MAX, exact=True)
        return (dt + torch.log(-torch.expm1(-dt))).float()   # softplus⁻¹
    if name.endswith("mixer.A_log"):
        return torch.log(d.uniform(shape, *A_RANGE, exact=True)).float()
    if name.endswith("mixer.D"):
        return d.uniform(shape, 0.5, 1.5)
    if name.endswith("mixer.out_proj.weight"):
        return d.normal(shape, 0.5 / math.sqrt(shape[1]))
    raise KeyError(name)


def synthetic_tensors(g: Geometry, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    d = Draws(seed)
    emb = None
    for name, shape in normal_shapes(g).items():
        if name == "lm_head.weight" and g.tie_embeddings:
            yield name, emb.clone()
            continue
        t = _init(name, shape, g, d).contiguous()
        if name == "backbone.embeddings.weight" and g.tie_embeddings:
            emb = t
        yield name, t


def synthetic_state_dict(g: Geometry, seed: int) -> dict[str, torch.Tensor]:
    return dict(synthetic_tensors(g, seed))
