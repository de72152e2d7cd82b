"""A deterministic, seeded random-init RWKV-6 (x060) in the normal form.

One generator draws every tensor in :func:`.geometry.normal_shapes` order (a tensor's values depend
on all before it), RANDN_CHUNK values per call: the same seed and shape give the same bytes, and a
65536 x 2048 table never needs a float64 copy.

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

from recurrent_coreai.families.rwkv6.geometry import Geometry, normal_shapes

LM_HEAD_GAIN = 3.0
LM_HEAD_ROW_SPREAD = 0.4
RANDN_CHUNK = 1 << 20
DECAY_RANGE = (-6.5, 0.0)      # time_decay: w = exp(-exp(d)) from 0.9985 to 0.37 before the LoRA term
BONUS_RANGE = (-0.5, 1.0)      # time_faaaa (u)


def _normal(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    out = torch.empty(shape, dtype=torch.float32)
    flat, at = out.view(-1), 0
    while at < flat.numel():
        n = min(RANDN_CHUNK, flat.numel() - at)
        flat[at:at + n] = torch.randn(n, generator=gen, dtype=torch.float32).mul_(std)
        at += n
    return out


def _uniform(shape: tuple[int, ...], lo: float, hi: float, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(shape, generator=gen, dtype=torch.float32) * (hi - lo) + lo


def _init(name: str, shape: tuple[int, ...], g: Geometry, gen: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if any(f".{n}." in name for n in ("pre_ln", "ln1", "ln2", "ln_x", "ln_out")):
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if name == "rwkv.embeddings.weight":
        return _normal(shape, 1.0, gen)
    if name == "head.weight":
        rows = torch.exp(torch.randn((shape[0], 1), generator=gen, dtype=torch.float32) * LM_HEAD_ROW_SPREAD)
        return _normal(shape, LM_HEAD_GAIN / math.sqrt(g.hidden), gen).mul_(rows)
    if leaf.startswith("time_maa_") and leaf not in ("time_maa_w1", "time_maa_w2"):
        return _uniform(shape, 0.0, 1.0, gen)
    if leaf == "time_maa_w1":
        return _normal(shape, 0.5 / math.sqrt(g.hidden), gen)
    if leaf == "time_maa_w2":
        return _normal(shape, 0.3 / math.sqrt(g.mix_lora), gen)
    if leaf == "time_decay":
        return _uniform(shape, *DECAY_RANGE, gen)
    if leaf == "time_decay_w1":
        return _normal(shape, 0.5 / math.sqrt(g.hidden), gen)
    if leaf == "time_decay_w2":
        return _normal(shape, 0.3 / math.sqrt(g.decay_lora), gen)
    if leaf == "time_faaaa":
        return _uniform(shape, *BONUS_RANGE, gen)
    if name.endswith(("attention.output.weight", "feed_forward.value.weight")):
        return _normal(shape, 0.5 / math.sqrt(shape[1]), gen)
    return _normal(shape, 1.0 / math.sqrt(shape[1]), gen)   # r/k/v/g, ffn key/receptance


def synthetic_tensors(g: Geometry, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(int(seed))
    for name, shape in normal_shapes(g).items():
        yield name, _init(name, shape, g, gen).contiguous()


def synthetic_state_dict(g: Geometry, seed: int) -> dict[str, torch.Tensor]:
    return dict(synthetic_tensors(g, seed))
