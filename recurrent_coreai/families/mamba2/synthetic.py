"""Seeded, deterministic random Mamba-2 weights in the normal form.

One generator draws every tensor in :func:`.geometry.normal_shapes` order (same seed and geometry:
the same bytes), by the policy of :mod:`recurrent_coreai.families.draws`. Ranges follow mamba_ssm's own init where it matters for the recurrence:
``A_log = log(U[1, 16])``; ``dt_bias = softplus⁻¹(dt)`` with dt log-uniform in [1e-3, 1e-1], so
``softplus(dt_in + dt_bias)`` stays around 1e-3..1e-1 for the in_proj's dt rows; D around 1.
Norm weights are 1 plus a little noise (a mix-up between norms shows). The lm_head is hotter
than 1/sqrt(C) with a log-normal spread of row norms (the idea of families/rwkv7/synthetic.py):
the logits are peaked, so teacher-forced top-1 comparisons mean something. A tied geometry's
lm_head is the embedding itself (drawn with the lm_head's recipe).

The draws of the tensors both Mamba families hold, and the loop, are families/ssm.py's; the
family's own mixer tensors are drawn here.
"""

from __future__ import annotations

from typing import Iterator

import torch

from recurrent_coreai.families import ssm
from recurrent_coreai.families.draws import Draws
from recurrent_coreai.families.mamba2.geometry import Geometry, normal_shapes
# the head's draw, under the names tests/families/test_source_streaming.py reads
from recurrent_coreai.families.ssm import LM_HEAD_GAIN, LM_HEAD_ROW_SPREAD  # noqa: F401
from recurrent_coreai.families.ssm import lm_head as _head  # noqa: F401


def _init(name: str, shape: tuple[int, ...], g: Geometry, d: Draws) -> torch.Tensor:
    if name.endswith("mixer.dt_bias"):
        return ssm.dt_bias(shape, d)
    return ssm.init(name, shape, g, d)


def synthetic_tensors(g: Geometry, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    return ssm.synthetic_tensors(normal_shapes(g), g, seed, _init)


def synthetic_state_dict(g: Geometry, seed: int) -> dict[str, torch.Tensor]:
    return dict(synthetic_tensors(g, seed))
