"""BlinkDL x070 ``.pth`` names <-> fla/HF names (both directions, exact tensors).

BlinkDL stores projections as ``att.receptance/key/value/output``, LoRA factors as
``w1`` [C,D] / ``w2`` [D,C] / ``w0`` [1,1,C] (transposes of fla's ``lora.0`` / ``lora.2``
and its bias), mixers and vectors as [1,1,C], ``r_k`` as [H,N], and the norms as
``ln0/ln1/ln2/ln_x/ln_out``.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from recurrent_coreai.families.rwkv7.geometry import MIXERS

_GLOBAL = {"emb.weight": "model.embeddings.weight", "head.weight": "lm_head.weight",
           "ln_out.weight": "model.norm.weight", "ln_out.bias": "model.norm.bias"}
_NORMS = {"ln0": "pre_norm", "ln1": "attn_norm", "ln2": "ffn_norm", "att.ln_x": "attn.g_norm"}
_PROJ = {"receptance": "r_proj", "key": "k_proj", "value": "v_proj", "output": "o_proj"}
_VEC = ("k_k", "k_a")  # [1,1,C] in BlinkDL, [C] in fla


def is_blinkdl(names) -> bool:
    return any(n.startswith("blocks.") for n in names)


def to_hf(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BlinkDL x070 state dict -> fla/HF split-mixer state dict. Unknown names pass through
    unchanged (prefixed with ``unknown:``) so that validation can name them."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = t
            continue
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
        if not m:
            out["unknown:" + name] = t
            continue
        p, rest = f"model.layers.{m.group(1)}.", m.group(2)
        norm = re.fullmatch(r"(ln0|ln1|ln2|att\.ln_x)\.(weight|bias)", rest)
        lora = re.fullmatch(r"att\.([wavg])([012])", rest)
        proj = re.fullmatch(r"att\.(receptance|key|value|output)\.weight", rest)
        if norm:
            out[f"{p}{_NORMS[norm.group(1)]}.{norm.group(2)}"] = t
        elif proj:
            out[f"{p}attn.{_PROJ[proj.group(1)]}.weight"] = t
        elif lora:
            which, idx = lora.groups()
            if which == "v" and m.group(1) == "0":
                continue  # some RWKV-LM versions store v0/v1/v2 in layer 0 too; x070 never uses them
            if idx == "1":
                out[f"{p}attn.{which}_lora.lora.0.weight"] = t.t().contiguous()
            elif idx == "2":
                out[f"{p}attn.{which}_lora.lora.2.weight"] = t.t().contiguous()
            else:
                out[f"{p}attn.{which}_lora.lora.2.bias"] = t.reshape(-1)
        elif re.fullmatch(r"att\.x_[rwkvag]", rest):
            out[f"{p}attn.{rest[4:]}"] = t.reshape(1, 1, -1)
        elif rest in (f"att.{v}" for v in _VEC):
            out[f"{p}attn.{rest[4:]}"] = t.reshape(-1)
        elif rest == "att.r_k":
            out[f"{p}attn.r_k"] = t
        elif rest == "ffn.x_k":
            out[f"{p}ffn.x_k"] = t.reshape(-1)
        elif rest in ("ffn.key.weight", "ffn.value.weight"):
            out[p + rest] = t
        else:
            out["unknown:" + name] = t
    return out


def from_hf(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fla/HF split-mixer state dict -> BlinkDL x070 names and shapes (what ``rwkv`` loads)."""
    inv_norm = {v: k for k, v in _NORMS.items()}
    inv_proj = {v: k for k, v in _PROJ.items()}
    inv_glob = {v: k for k, v in _GLOBAL.items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name in inv_glob:
            out[inv_glob[name]] = t
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if not m:
            raise KeyError(name)
        p, rest = f"blocks.{m.group(1)}.", m.group(2)
        norm = re.fullmatch(r"(pre_norm|attn_norm|ffn_norm|attn\.g_norm)\.(weight|bias)", rest)
        proj = re.fullmatch(r"attn\.([rkvo]_proj)\.weight", rest)
        lora = re.fullmatch(r"attn\.([wavg])_lora\.lora\.([02])\.(weight|bias)", rest)
        if norm:
            out[f"{p}{inv_norm[norm.group(1)]}.{norm.group(2)}"] = t
        elif proj:
            out[f"{p}att.{inv_proj[proj.group(1)]}.weight"] = t
        elif lora:
            which, idx, kind = lora.groups()
            if kind == "bias":
                out[f"{p}att.{which}0"] = t.reshape(1, 1, -1)
            else:
                out[f"{p}att.{which}{'1' if idx == '0' else '2'}"] = t.t().contiguous()
        elif rest in (f"attn.x_{x}" for x in MIXERS):
            out[f"{p}att.{rest[5:]}"] = t.reshape(1, 1, -1)
        elif rest in (f"attn.{v}" for v in _VEC):
            out[f"{p}att.{rest[5:]}"] = t.reshape(1, 1, -1)
        elif rest == "attn.r_k":
            out[f"{p}att.r_k"] = t
        elif rest == "ffn.x_k":
            out[f"{p}ffn.x_k"] = t.reshape(1, 1, -1)
        elif rest in ("ffn.key.weight", "ffn.value.weight"):
            out[p + rest] = t
        else:
            raise KeyError(name)
    return out


def original_name(hf_name: str) -> str:
    """The BlinkDL name of an fla/HF tensor name (for messages about a .pth file)."""
    try:
        return next(iter(from_hf({hf_name: torch.zeros(1)})))
    except KeyError:
        return hf_name
