"""A deterministic, seeded random-init RWKV-7 in the exact HF (fla) layout.

Same seed and shape -> byte-identical ``model.safetensors``. The initialisation keeps
norms at 1, projections at ~1/sqrt(fan_in) and the lm_head a little hotter, so the
logits are peaked (a clear top-1 at most steps) and teacher-forced top-1 comparisons
mean something.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from . import blinkdl
from .checkpoint import save_normalized
from .geometry import MIXERS, Geometry, expected_shapes
from .paths import WEIGHT_FILE
from .progress import Progress

LM_HEAD_GAIN = 3.0      # base logit std
LM_HEAD_ROW_SPREAD = 0.4  # log-normal spread of lm_head row norms: a few tokens stand out,
                          # so top-2 margins are mostly far above fp16 noise (peaked logits)


def _init(name: str, shape: tuple[int, ...], g: Geometry, gen: torch.Generator) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64).mul(std).float()

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return (torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo).float()

    leaf = name.split(".", 3)[-1]
    if "norm" in name:  # pre/attn/ffn/g_norm and model.norm: weight 1, bias 0
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    if name == "model.embeddings.weight":
        return normal(1.0)
    if name == "lm_head.weight":
        rows = torch.exp(torch.randn((shape[0], 1), generator=gen, dtype=torch.float64) * LM_HEAD_ROW_SPREAD)
        return (normal(LM_HEAD_GAIN / math.sqrt(g.hidden)).double() * rows).float()
    if ".attn.x_" in name or name.endswith("ffn.x_k"):
        return uniform(0.0, 1.0)
    if name.endswith("attn.k_k"):
        return uniform(0.7, 1.0)
    if name.endswith("attn.k_a"):
        return uniform(0.8, 1.2)
    if name.endswith("attn.r_k"):
        return normal(0.2)
    if "_lora.lora.2.bias" in name:
        lo, hi = {"w": (-4.0, 2.0), "a": (-1.0, 1.0), "v": (-1.0, 1.0)}[leaf.split(".")[1][0]]
        return uniform(lo, hi)
    if "_lora.lora." in name:
        return normal(0.5 / math.sqrt(shape[1]))
    if name.endswith("o_proj.weight"):
        return normal(0.5 / math.sqrt(shape[1]))
    if name.endswith("ffn.value.weight"):
        return normal(0.5 / math.sqrt(shape[1]))
    return normal(1.0 / math.sqrt(shape[1]))  # r/k/v projections, ffn.key


def synthetic_state_dict(g: Geometry, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(int(seed))
    shapes = expected_shapes(g)
    out = {}
    with Progress("synthesising weights", total=sum(math.prod(s) for s in shapes.values()), unit="params") as bar:
        for name, shape in shapes.items():
            out[name] = _init(name, shape, g, gen).contiguous()
            bar.update(math.prod(shape))
    return out


def pack_mixers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split -> the older fla layout with ``attn.x_x`` [6,C] (for tests of the loader)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if ".attn.x_" in name:
            prefix = name.rsplit(".", 1)[0]
            if prefix + ".x_x" not in out:
                out[prefix + ".x_x"] = torch.stack([sd[f"{prefix}.x_{m}"].reshape(-1) for m in MIXERS])
        else:
            out[name] = t
    return out


def write_weights(sd: dict[str, torch.Tensor], out_dir: Path, layout: str) -> Path:
    if layout == "fla-split":
        path = out_dir / WEIGHT_FILE
        save_normalized(sd, path)
    elif layout == "fla-packed":
        path = out_dir / WEIGHT_FILE
        save_normalized(pack_mixers(sd), path)
    elif layout == "blinkdl":
        path = out_dir / "model.pth"
        torch.save(blinkdl.from_hf(sd), path)
    else:
        raise ValueError(layout)
    return path
