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

The draws of the tensors both Mamba families hold, and the loop, are families/ssm.py's; the
family's own mixer tensors are drawn here.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from recurrent_coreai.families import ssm
from recurrent_coreai.families.draws import Draws
from recurrent_coreai.families.mamba1.geometry import Geometry, normal_shapes


def _init(name: str, shape: tuple[int, ...], g: Geometry, d: Draws) -> torch.Tensor:
    if name.endswith("mixer.x_proj.weight"):
        return d.normal(shape, 1.0 / math.sqrt(shape[1]))
    if name.endswith("mixer.dt_proj.weight"):
        bound = 1.0 / math.sqrt(shape[1])
        return d.uniform(shape, -bound, bound)
    if name.endswith("mixer.dt_proj.bias"):
        return ssm.dt_bias(shape, d)
    return ssm.init(name, shape, g, d)


def synthetic_tensors(g: Geometry, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    return ssm.synthetic_tensors(normal_shapes(g), g, seed, _init)


def synthetic_state_dict(g: Geometry, seed: int) -> dict[str, torch.Tensor]:
    return dict(synthetic_tensors(g, seed))
