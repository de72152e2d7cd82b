"""A deterministic, seeded random-init RWKV-7 in the exact HF (fla) layout.

Same seed and shape -> byte-identical ``model.safetensors``. The initialisation keeps
norms at 1, projections at ~1/sqrt(fan_in) and the lm_head a little hotter, so the
logits are peaked (a clear top-1 at most steps) and teacher-forced top-1 comparisons
mean something.

:func:`write_synthetic` writes model.safetensors one tensor at a time, as each is drawn (the
same bytes as ``write_weights(synthetic_state_dict(...))``): the 1.5B geometry's 6.1 GB
checkpoint is never held whole.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Iterator

import torch

from recurrent_coreai.families import draws
from recurrent_coreai.families.rwkv7 import blinkdl
from recurrent_coreai.families.rwkv7.geometry import MIXERS, Geometry, expected_shapes
from recurrent_coreai.util.progress import Progress
from recurrent_coreai.util.safetensors_stream import NORMAL_METADATA, WEIGHT_FILE, save_normalized, save_streamed

LM_HEAD_GAIN = 3.0      # base logit std
LM_HEAD_ROW_SPREAD = 0.4  # log-normal spread of lm_head row norms: a few tokens stand out,
                          # so top-2 margins are mostly far above fp16 noise (peaked logits)
RANDN_CHUNK = draws.RANDN_CHUNK  # normal values drawn per call (families/draws.py)
ROW_CHUNK = 512        # lm_head rows rescaled at a time (float64 temporaries of 512 x hidden)


def chunked_normal(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    """:func:`recurrent_coreai.families.draws.chunked_normal` in float64, cast to float32, RANDN_CHUNK
    values per call (tests/test_synthetic.py checks it against the one-call form)."""
    return draws.chunked_normal(shape, std, gen, chunk=RANDN_CHUNK)


def _init(name: str, shape: tuple[int, ...], g: Geometry, d: draws.Draws) -> torch.Tensor:
    leaf = name.split(".", 3)[-1]
    if "norm" in name:  # pre/attn/ffn/g_norm and model.norm: weight 1, bias 0
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    if name == "model.embeddings.weight":
        return d.normal(shape, 1.0)
    if name == "lm_head.weight":
        rows = torch.exp(d.normal((shape[0], 1), LM_HEAD_ROW_SPREAD, exact=True))
        w = d.normal(shape, LM_HEAD_GAIN / math.sqrt(g.hidden))
        for at in range(0, shape[0], ROW_CHUNK):  # (w.double() * rows).float(), in row slices
            w[at:at + ROW_CHUNK] = w[at:at + ROW_CHUNK].double() * rows[at:at + ROW_CHUNK]
        return w
    if ".attn.x_" in name or name.endswith("ffn.x_k"):
        return d.uniform(shape, 0.0, 1.0)
    if name.endswith("attn.k_k"):
        return d.uniform(shape, 0.7, 1.0)
    if name.endswith("attn.k_a"):
        return d.uniform(shape, 0.8, 1.2)
    if name.endswith("attn.r_k"):
        return d.normal(shape, 0.2)
    if "_lora.lora.2.bias" in name:
        lo, hi = {"w": (-4.0, 2.0), "a": (-1.0, 1.0), "v": (-1.0, 1.0)}[leaf.split(".")[1][0]]
        return d.uniform(shape, lo, hi)
    if "_lora.lora." in name:
        return d.normal(shape, 0.5 / math.sqrt(shape[1]))
    if name.endswith("o_proj.weight"):
        return d.normal(shape, 0.5 / math.sqrt(shape[1]))
    if name.endswith("ffn.value.weight"):
        return d.normal(shape, 0.5 / math.sqrt(shape[1]))
    return d.normal(shape, 1.0 / math.sqrt(shape[1]))  # r/k/v projections, ffn.key


def synthetic_tensors(g: Geometry, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in expected_shapes order, one at a time. One generator draws them all in this
    order: a tensor's values depend on every tensor before it."""
    d = draws.Draws(seed)
    shapes = expected_shapes(g)
    with Progress("synthesising weights", total=sum(math.prod(s) for s in shapes.values()), unit="params") as bar:
        for name, shape in shapes.items():
            yield name, _init(name, shape, g, d).contiguous()
            bar.update(math.prod(shape))


def synthetic_state_dict(g: Geometry, seed: int) -> dict[str, torch.Tensor]:
    return dict(synthetic_tensors(g, seed))


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


def _packed_name(name: str) -> str:
    return name.rsplit(".", 1)[0] + ".x_x" if ".attn.x_" in name else name


def pack_mixers_stream(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`pack_mixers` on (name, tensor) pairs: each layer's ``attn.x_x`` once its six mixers passed."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in pairs:
        if ".attn.x_" not in name:
            yield name, t
            del t  # not held while the next one is drawn
            continue
        prefix, leaf = name.rsplit(".", 1)
        mixers = held.setdefault(prefix, {})
        mixers[leaf[2:]] = t
        if len(mixers) == len(MIXERS):
            del held[prefix]
            yield prefix + ".x_x", torch.stack([mixers[m].reshape(-1) for m in MIXERS])
    if held:
        raise ValueError(f"incomplete mixers of {sorted(held)[0]}")


def layout_shapes(g: Geometry, layout: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors of ``layout`` (fla-split or fla-packed)."""
    shapes = expected_shapes(g)
    if layout == "fla-split":
        return shapes
    if layout == "fla-packed":
        out = {}
        for name, shape in shapes.items():
            packed = _packed_name(name)
            out[packed] = (len(MIXERS), g.hidden) if packed != name else shape
        return out
    raise ValueError(layout)


def write_synthetic(g: Geometry, seed: int, out_dir: Path, layout: str) -> Path:
    """``write_weights(synthetic_state_dict(g, seed), out_dir, layout)``, the same bytes, but each
    tensor written to model.safetensors as it is drawn (blinkdl: through the whole state dict)."""
    if layout == "blinkdl":
        return write_weights(synthetic_state_dict(g, seed), out_dir, layout)
    pairs = synthetic_tensors(g, seed)
    specs = {name: (torch.float32, shape) for name, shape in layout_shapes(g, layout).items()}
    return save_streamed(out_dir / WEIGHT_FILE, specs, pairs if layout == "fla-split" else pack_mixers_stream(pairs),
                         NORMAL_METADATA)


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
