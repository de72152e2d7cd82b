"""RWKV-7 checkpoint layouts and their normalisation to the normal form (fla/HF, split mixers).

Accepted: ``fla-split`` (fla/HF with ``attn.x_r`` … ``attn.x_g``, the normal form), ``fla-packed``
(older fla: the six mixers packed as ``attn.x_x`` [6,C]) and ``blinkdl`` (BlinkDL x070 ``.pth``
names, mapped by :mod:`.blinkdl`). The normal form is :func:`.geometry.expected_shapes`, checked
name by name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Mapping

import torch

from recurrent_coreai.families.rwkv7 import blinkdl
from recurrent_coreai.families.rwkv7.geometry import MIXERS, Geometry, expected_shapes
from recurrent_coreai.util.errors import PipelineError

LAYOUTS = ("fla-split", "fla-packed", "blinkdl")
# names only RWKV-7 checkpoints carry (fla spelling; BlinkDL x070 spelling)
_FLA_SIGNS = re.compile(r"model\.layers\.\d+\.attn\.(k_k|k_a|r_k|x_x|w_lora\.|a_lora\.)")
_BLINKDL_SIGNS = re.compile(r"blocks\.\d+\.att\.(r_k|k_k|k_a|w1|a1)$")


def detect_layout(names: Iterable[str]) -> str | None:
    names = list(names)
    if any(_BLINKDL_SIGNS.match(n) for n in names):
        return "blinkdl"
    if not any(_FLA_SIGNS.match(n) for n in names):
        return None
    if any(n.endswith(".attn.x_x") for n in names):
        return "fla-packed"
    return "fla-split"


def original_name(layout: str, normal: str) -> str:
    """The name a checkpoint in ``layout`` stores the normal-form tensor ``normal`` under (messages
    about a file name its own tensors); a packed mixer's is its ``attn.x_x``."""
    if layout == "blinkdl":
        return blinkdl.original_name(normal)
    if layout == "fla-packed" and re.fullmatch(r"model\.layers\.\d+\.attn\.x_[rwkvag]", normal):
        return normal[:-len("x_r")] + "x_x"
    return normal


def unpack_mixers(sd: dict[str, torch.Tensor], where: str | Path) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in sd.items():
        if name.endswith(".attn.x_x") and t.dim() == 2 and t.shape[0] == len(MIXERS):
            prefix = name[: -len("x_x")]
            split = [f"{prefix}x_{m}" for m in MIXERS if f"{prefix}x_{m}" in sd]
            if split:
                raise PipelineError(where, f"{name} (packed mixers) and {split[0]} (split) are both present",
                                    "keep one mixer layout per layer: remove attn.x_x or the attn.x_r ... x_g tensors")
            for row, m in enumerate(MIXERS):
                out[f"{prefix}x_{m}"] = t[row].reshape(1, 1, -1).clone()
        else:
            out[name] = t
    return out


def normal_parts(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The normal-form tensors one fla tensor becomes (see :func:`unpack_mixers`)."""
    if name.endswith(".attn.x_x") and t.dim() == 2 and t.shape[0] == len(MIXERS):
        return [(f"{name[:-len('x_x')]}x_{m}", t[row].reshape(1, 1, -1)) for row, m in enumerate(MIXERS)]
    return [(name, t)]


def normalize(sd: Mapping[str, torch.Tensor], geom: Geometry, where: str | Path) -> dict[str, torch.Tensor]:
    """Any accepted layout -> the split fla layout; every name and shape checked."""
    layout = detect_layout(sd.keys()) or "fla-split"
    if layout == "blinkdl":
        sd = blinkdl.to_hf(sd)
    sd = unpack_mixers(dict(sd), where)
    want = expected_shapes(geom)

    def label(name: str) -> str:
        return f"{name} (BlinkDL {blinkdl.original_name(name)})" if layout == "blinkdl" else name

    fix_shape = ("the .pth is not a consistent RWKV-7 x070 checkpoint" if layout == "blinkdl"
                 else "check that config.json matches the weights")
    for name, shape in want.items():
        if name not in sd:
            raise PipelineError(where, f"tensor {label(name)} is missing (expected shape {list(shape)})",
                                "use a complete RWKV-7 checkpoint whose config.json matches its weights"
                                if layout != "blinkdl" else "use a complete RWKV-7 x070 .pth")
        if tuple(sd[name].shape) != shape:
            raise PipelineError(where, f"tensor {label(name)} has shape {list(sd[name].shape)}, expected {list(shape)}",
                                fix_shape)
    extra = sorted(set(sd) - set(want))
    if extra:
        name = extra[0].removeprefix("unknown:")
        raise PipelineError(where, f"unexpected tensor {name} ({len(extra)} unexpected in all)",
                            "this is not a plain RWKV-7 x070 checkpoint; remove the extra tensors")
    return {name: sd[name] for name in want}


def geometry_from_tensors(shapes: Mapping[str, tuple[int, ...]], where: str | Path) -> Geometry:
    """A BlinkDL .pth carries no config.json: read the shape off its tensors."""
    def shape(name: str) -> tuple[int, int]:
        if name not in shapes:
            raise PipelineError(where, f"tensor {name} is missing", "use a complete BlinkDL x070 checkpoint")
        if len(shapes[name]) != 2:
            raise PipelineError(where, f"tensor {name} has shape {list(shapes[name])}, expected 2 dimensions",
                                "the .pth is not a consistent RWKV-7 x070 checkpoint")
        return tuple(shapes[name])

    vocab, hidden = shape("emb.weight")
    heads, head_dim = shape("blocks.0.att.r_k")
    layers = 1 + max((int(m.group(1)) for n in shapes if (m := re.match(r"blocks\.(\d+)\.", n))), default=-1)
    return Geometry(layers=layers, hidden=hidden, head_dim=head_dim, ffn=shape("blocks.0.ffn.key.weight")[0],
                    vocab=vocab, decay_lora=shape("blocks.0.att.w1")[1], a_lora=shape("blocks.0.att.a1")[1],
                    v_lora=shape("blocks.1.att.v1")[1] if layers > 1 else 1,
                    gate_lora=shape("blocks.0.att.g1")[1]).check(where)
