"""RWKV-6 checkpoint layouts and their normalisation to ONE normal form.

* ``hf`` (the normal form): the names of ``RWKV/v6-Finch-*-HF`` (transformers remote code,
  ``model_type: rwkv6``): ``rwkv.embeddings.weight``, ``rwkv.blocks.<i>.{pre_ln,ln1,ln2}``,
  ``rwkv.blocks.<i>.attention.time_maa_*|time_decay*|time_faaaa|receptance|key|value|gate|output|ln_x``,
  ``rwkv.blocks.<i>.feed_forward.{time_maa_k,time_maa_r,key,receptance,value}``, ``rwkv.ln_out``,
  ``head.weight``; ``model.safetensors`` + ``config.json``.
* ``blinkdl``: BlinkDL's x060 ``.pth`` (``emb.weight``, ``blocks.0.ln0``, ``blocks.<i>.att.*``,
  ``blocks.<i>.ffn.*``, ``ln_out``, ``head.weight``), no config.json.

The two differ by names only (same shapes, same orientation: the HF conversion is a rename), so
both normalise tensor by tensor (:func:`normal_parts`) and a checkpoint can be streamed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

from recurrent_coreai.families.rwkv6.geometry import Geometry, config_json, geometry_from_tensors, normal_shapes
from recurrent_coreai.util.errors import PipelineError

HF, BLINKDL = "hf", "blinkdl"
LAYOUTS = (HF, BLINKDL)
WEIGHT_FILES = {HF: "model.safetensors", BLINKDL: "model.pth"}
NORMAL_METADATA = {"format": "pt"}
LABELS = {HF: "RWKV-6 HF (RWKV/v6-Finch-*-HF) checkpoint", BLINKDL: "BlinkDL x060 .pth"}

# The one rename between the layouts: (normal-form prefix, BlinkDL prefix), most specific first;
# {i} stands for a layer index. Each direction is compiled from it.
_PREFIXES = (
    ("rwkv.embeddings.", "emb."),
    ("rwkv.blocks.0.pre_ln.", "blocks.0.ln0."),
    ("rwkv.blocks.{i}.attention.", "blocks.{i}.att."),
    ("rwkv.blocks.{i}.feed_forward.", "blocks.{i}.ffn."),
    ("rwkv.blocks.{i}.ln1.", "blocks.{i}.ln1."),
    ("rwkv.blocks.{i}.ln2.", "blocks.{i}.ln2."),
    ("rwkv.ln_out.", "ln_out."),
)


def _direction(pairs) -> tuple[tuple[re.Pattern, str], ...]:
    """(pattern matching a ``from`` prefix, its replacement) for each (from, to) prefix pair."""
    return tuple((re.compile("^" + re.escape(src).replace(re.escape("{i}"), r"(\d+)")), dst.replace("{i}", r"\1"))
                 for src, dst in pairs)


_HF_TO_BLINK = _direction(_PREFIXES)
_BLINK_TO_HF = _direction((blink, hf) for hf, blink in _PREFIXES)


def _rename(name: str, table) -> str | None:
    if name == "head.weight":
        return name
    for pattern, repl in table:
        if pattern.match(name):
            return pattern.sub(repl, name, count=1)
    return None


def to_blinkdl_name(name: str) -> str:
    out = _rename(name, _HF_TO_BLINK)
    return out if out is not None else name


def from_blinkdl_name(name: str) -> str | None:
    """The normal-form name of a BlinkDL tensor name; None if it has no place in x060."""
    return _rename(name, _BLINK_TO_HF)


def detect_layout(names: Iterable[str]) -> str | None:
    names = set(names)
    if "emb.weight" in names and any(n.endswith(".att.time_maa_w1") for n in names):
        return BLINKDL
    if "rwkv.embeddings.weight" in names and any(n.endswith(".attention.time_maa_w1") for n in names):
        return HF
    return None


def original_name(layout: str, normal: str) -> str:
    return to_blinkdl_name(normal) if layout == BLINKDL else normal


def normal_parts(layout: str, name: str, tensor: Any) -> list[tuple[str, Any]]:
    """One stored tensor -> its normal-form tensor (a rename). A BlinkDL name with no place in
    x060 keeps its own name, so that :func:`normalize` reports it as unexpected."""
    if layout == HF:
        return [(name, tensor)]
    if layout == BLINKDL:
        return [(from_blinkdl_name(name) or name, tensor)]
    raise ValueError(f"unknown rwkv6 layout {layout!r} (one of {', '.join(LAYOUTS)})")


def normalize(sd: Mapping[str, Any], geom: Geometry, where: str | Path, layout: str | None = None) -> dict[str, Any]:
    """Either layout -> the normal form, in :func:`normal_shapes` order; every name and shape
    checked. A missing, extra or mis-shaped tensor is one line naming it (and its name in the
    layout it came from) with the expected shape."""
    layout = layout or detect_layout(sd.keys()) or HF
    renamed: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name, t in sd.items():
        for normal, part in normal_parts(layout, name, t):
            renamed[normal], origin[normal] = part, name
    want = normal_shapes(geom)

    def label(normal: str) -> str:
        orig = original_name(layout, normal)
        return normal if orig == normal else f"{normal} (BlinkDL {orig})"

    what = LABELS[layout]
    for name, shape in want.items():
        if name not in renamed:
            raise PipelineError(where, f"tensor {label(name)} is missing (expected shape {list(shape)})",
                                f"use a complete {what}" + ("" if layout == BLINKDL else " whose config.json matches its weights"))
        got = tuple(renamed[name].shape)
        if got != shape:
            raise PipelineError(where, f"tensor {label(name)} has shape {list(got)}, expected {list(shape)}",
                                f"the {what} is not consistent" + ("" if layout == BLINKDL else
                                                                   " (check that config.json matches the weights)"))
    extra = [n for n in renamed if n not in want]
    if extra:
        name = origin[extra[0]]
        raise PipelineError(where, f"unexpected tensor {name} ({len(extra)} unexpected in all)",
                            f"this is not a plain RWKV-6 x060 checkpoint ({what}); remove the extra tensors")
    return {name: renamed[name] for name in want}


def blinkdl_names() -> dict[str, str]:
    """What :func:`geometry.geometry_from_tensors` reads, in BlinkDL names."""
    return {"emb": "emb.weight", "faaaa": "blocks.0.att.time_faaaa", "ffn_key": "blocks.0.ffn.key.weight",
            "maa_w1": "blocks.0.att.time_maa_w1", "decay_w1": "blocks.0.att.time_decay_w1",
            "block_re": r"^blocks\.(\d+)\."}


def hf_names() -> dict[str, str]:
    return {"emb": "rwkv.embeddings.weight", "faaaa": "rwkv.blocks.0.attention.time_faaaa",
            "ffn_key": "rwkv.blocks.0.feed_forward.key.weight", "maa_w1": "rwkv.blocks.0.attention.time_maa_w1",
            "decay_w1": "rwkv.blocks.0.attention.time_decay_w1", "block_re": r"^rwkv\.blocks\.(\d+)\."}


def write_streamed(tensors: Iterable[tuple[str, Any]], out_dir: Path, geom: Geometry) -> Path:
    """What :func:`write_layout` writes in the ``hf`` layout (the same bytes: model.safetensors and
    config.json), from normal-form (name, tensor) pairs in normal_shapes order, holding one tensor at
    a time: a synthetic 1.6B (6.4 GB) is written in the memory of its largest tensor."""
    import torch

    from recurrent_coreai.util.safetensors_stream import save_streamed

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = normal_shapes(geom)
    path = out_dir / WEIGHT_FILES[HF]
    save_streamed(path, {n: (torch.float32, s) for n, s in shapes.items()},
                  ((n, t.contiguous()) for n, t in tensors), NORMAL_METADATA)
    # config.json as write_layout makes it: from the geometry the tensor shapes give

    written = geometry_from_tensors(shapes, hf_names(), LABELS[HF], out_dir)
    (out_dir / "config.json").write_text(json.dumps(config_json(written), indent=2) + "\n")
    return path


def write_layout(sd: Mapping[str, Any], out_dir: Path, layout: str) -> Path:
    """Normal-form weights written in ``layout``: ``hf`` -> model.safetensors (save_file, metadata
    {"format": "pt"}) + config.json; ``blinkdl`` -> model.pth (torch.save), no config.json."""
    import torch
    from safetensors.torch import save_file


    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / WEIGHT_FILES.get(layout, "")
    if layout == HF:
        geom = geometry_from_tensors({k: tuple(v.shape) for k, v in sd.items()}, hf_names(), LABELS[HF], out_dir)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata=NORMAL_METADATA)
        (out_dir / "config.json").write_text(json.dumps(config_json(geom), indent=2) + "\n")
    elif layout == BLINKDL:
        torch.save({to_blinkdl_name(k): v.contiguous() for k, v in sd.items()}, path)
    else:
        raise ValueError(f"unknown rwkv6 layout {layout!r} (one of {', '.join(LAYOUTS)})")
    return path
