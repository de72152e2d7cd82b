"""Read an RWKV-7 checkpoint in any of the layouts we accept and normalise it.

Accepted: fla/HF with split mixers (``attn.x_r`` … ``attn.x_g``), older fla with the
packed ``attn.x_x`` [6,C], and BlinkDL x070 ``.pth``. The normal form is the split fla
layout of :func:`rwkv7_coreai.geometry.expected_shapes`, validated name by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import blinkdl
from .errors import PipelineError
from .geometry import MIXERS, Geometry, expected_shapes

WEIGHT_FILE = "model.safetensors"


def weight_files(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    files = sorted(src.glob("*.safetensors"))
    if not files:
        files = sorted(src.glob("*.pth"))
    if not files:
        raise PipelineError(src, "no *.safetensors or *.pth weights found",
                            "point the source at a directory holding the checkpoint")
    return files


def read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """All tensors of the given files (safetensors are mmap'd, not copied)."""
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".pth":
            try:
                sd = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
            except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
                raise PipelineError(f, f"cannot read PyTorch checkpoint ({type(exc).__name__}: {exc})",
                                    "re-download the file; it is truncated or not a state dict") from None
            out.update(sd)
            continue
        try:
            with safe_open(f, framework="pt") as fh:
                for name in fh.keys():
                    out[name] = fh.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types for bad headers
            raise PipelineError(f, f"cannot read safetensors ({exc})",
                                "re-download the file; it is truncated or corrupted") from None
    return out


def _unpack_mixers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in sd.items():
        if name.endswith(".attn.x_x") and t.dim() == 2 and t.shape[0] == len(MIXERS):
            prefix = name[: -len("x_x")]
            for row, m in enumerate(MIXERS):
                out[f"{prefix}x_{m}"] = t[row].reshape(1, 1, -1).clone()
        else:
            out[name] = t
    return out


def detect_layout(names) -> str:
    if blinkdl.is_blinkdl(names):
        return "blinkdl"
    if any(n.endswith(".attn.x_x") for n in names):
        return "fla-packed"
    return "fla-split"


def normalize(sd: Mapping[str, torch.Tensor], geom: Geometry, where: str | Path) -> dict[str, torch.Tensor]:
    """Any accepted layout -> the split fla layout; every name and shape checked."""
    layout = detect_layout(sd.keys())
    if layout == "blinkdl":
        sd = blinkdl.to_hf(sd)
    sd = _unpack_mixers(dict(sd))
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


def load_geometry(src: Path) -> Geometry:
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise PipelineError(src, "config.json is missing", "use a snapshot in Hugging Face layout (config.json + weights)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise PipelineError(cfg_path, f"invalid JSON ({exc.msg} at line {exc.lineno})", "repair or re-download config.json") from None
    return Geometry.from_hf_config(cfg, cfg_path)


def infer_blinkdl_geometry(sd: Mapping[str, torch.Tensor], where: str | Path) -> Geometry:
    """A BlinkDL .pth carries no config.json: read the shape off its tensors."""
    try:
        vocab, hidden = sd["emb.weight"].shape
        heads, head_dim = sd["blocks.0.att.r_k"].shape
        layers = 1 + max(int(n.split(".")[1]) for n in sd if n.startswith("blocks."))
        return Geometry(layers=layers, hidden=hidden, head_dim=head_dim, ffn=sd["blocks.0.ffn.key.weight"].shape[0],
                        vocab=vocab, decay_lora=sd["blocks.0.att.w1"].shape[1], a_lora=sd["blocks.0.att.a1"].shape[1],
                        v_lora=sd["blocks.1.att.v1"].shape[1] if layers > 1 else 1,
                        gate_lora=sd["blocks.0.att.g1"].shape[1]).check(where)
    except KeyError as exc:
        raise PipelineError(where, f"tensor {exc.args[0]} is missing", "use a complete BlinkDL x070 checkpoint") from None


def load_checkpoint(src: str | Path, dtype: torch.dtype | None = None) -> tuple[Geometry, dict[str, torch.Tensor]]:
    """Geometry and normalised weights of an HF-layout directory or a single weights file
    (weights mmap'd where possible). A BlinkDL .pth needs no config.json."""
    src = Path(src)
    files = weight_files(src)
    where = files[0] if len(files) == 1 else src
    raw = read_tensors(files)
    cfg_dir = src if src.is_dir() else src.parent
    if detect_layout(raw.keys()) == "blinkdl" and not (cfg_dir / "config.json").is_file():
        geom = infer_blinkdl_geometry(raw, where)
    else:
        geom = load_geometry(cfg_dir)
    sd = normalize(raw, geom, where)
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    return geom, sd


def save_normalized(sd: Mapping[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata={"format": "pt"})
