"""A deterministic, seeded random-init RWKV-6 (x060) in the normal form.

One generator draws every tensor in :func:`.geometry.normal_shapes` order (a tensor's values depend
on all before it), by the policy of :mod:`recurrent_coreai.families.draws` except that RWKV-6 draws
in float32: the same seed and shape give the same bytes.

Choices that keep the synthetic model meaningful for top-1 comparisons (as RWKV-7's synthetic
init does): every norm has weight 1 and bias 0; projections ~1/sqrt(fan_in); the head hotter
(gain 3) with a log-normal spread of row norms, so a few tokens stand out and the logits are
peaked. The decays are realistic: time_decay uniform in [-6.5, 0] plus a small LoRA term, so
w = exp(-exp(.)) spans about 0.998 (long memory) down to about 0.3 (fast forgetting).
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from recurrent_coreai.families.draws import Draws
from recurrent_coreai.families.rwkv6.geometry import Geometry, normal_shapes

LM_HEAD_GAIN = 3.0
LM_HEAD_ROW_SPREAD = 0.4
DECAY_RANGE = (-6.5, 0.0)      # time_decay: w = exp(-exp(d)) from 0.9985 to 0.37 before the LoRA term
BONUS_RANGE = (-0.5, 1.0)      # time_faaaa (u)


def _init(name: str, shape: tuple[int, ...], g: Geometry, d: Draws) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if any(f".{n}." in name for n in ("pre_ln", "ln1", "ln2", "ln_x", "ln_out")):
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if name == "rwkv.embeddings.weight":
        return d.normal(shape, 1.0)
    if name == "head.weight":
        rows = torch.exp(d.normal((shape[0], 1), LM_HEAD_ROW_SPREAD, exact=True))
        return d.normal(shape, LM_HEAD_GAIN / math.sqrt(g.hidden)).mul_(rows)
    if leaf.startswith("time_maa_") and leaf not in ("time_maa_w1", "time_maa_w2"):
        return d.uniform(shape, 0.0, 1.0)
    if leaf == "time_maa_w1":
        return d.normal(shape, 0.5 / math.sqrt(g.hidden))
    if leaf == "time_maa_w2":
        return d.normal(shape, 0.3 / math.sqrt(g.mix_lora))
    if leaf == "time_decay":
        return d.uniform(shape, *DECAY_RANGE)
    if leaf == "time_decay_w1":
        return d.normal(shape, 0.5 / math.sqrt(g.hidden))
    if leaf == "time_decay_w2":
        return d.normal(shape, 0.3 / math.sqrt(g.decay_lora))
    if leaf == "time_faaaa":
        return d.uniform(shape, *BONUS_RANGE)
    if name.endswith(("attention.output.weight", "feed_forward.value.weight")):
        return d.normal(shape, 0.5 / math.sqrt(shape[1]))
    return d.normal(shape, 1.0 / math.sqrt(shape[1]))   # r/k/v/g, ffn key/receptance


def synthetic_tensors(g: Geometry, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    d = Draws(seed, torch.float32)  # RWKV-6 draws in float32 (families/draws.py: its bytes predate the float64 rule)
    for name, shape in normal_shapes(g).items():
        yield name, _init(name, shape, g, d).contiguous()


def synthetic_state_dict(g: Geometry, seed: int) -> dict[str, torch.Tensor]:
    return dict(synthetic_tensors(g, seed))
