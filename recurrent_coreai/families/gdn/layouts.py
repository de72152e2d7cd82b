"""Gated DeltaNet checkpoint layouts and their normalisation to ONE normal form.

* ``fla`` (the normal form): flash-linear-attention's ``GatedDeltaNetForCausalLM`` as
  ``save_pretrained`` writes it: ``model.safetensors`` (or shards + index) and fla's config.json
  (``model_type: gated_deltanet``); names in :func:`.geometry.normal_shapes`.
* ``fla-zero-d``: the same plus one ``model.layers.{i}.attn.D`` per layer, as some published
  checkpoints carry (m-a-p/1.3B-100B-GatedDeltaNet-pure: 24 all-zero ``attn.D``). fla's
  GatedDeltaNet has no D (no skip term), so the rule is: an ``attn.D`` whose every value is 0 is
  dropped (it adds nothing); a nonzero one is refused naming the tensor (it would change the math
  fla computes, and fla itself does not load it).
* ``fla-tied``: ``tie_word_embeddings: true`` and no ``lm_head.weight`` (as transformers saves a tied
  model); the normal form materialises the head as a copy of the embedding.

Every layout differs from the normal form by names only, so a checkpoint streams tensor by tensor
(:func:`normal_parts`). Anything else unexpected is refused naming the tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

from recurrent_coreai.families.gdn.geometry import Geometry, config_json, geometry_from_config, normal_shapes
from recurrent_coreai.util.errors import PipelineError

FLA, ZERO_D, TIED = "fla", "fla-zero-d", "fla-tied"
LAYOUTS = (FLA, ZERO_D, TIED)
SYNTHETIC_LAYOUTS = (FLA, ZERO_D)     # a tied synthetic model is written in fla-tied by write_layout on its own
WEIGHT_FILE = "model.safetensors"
EMBED, HEAD = "model.embeddings.weight", "lm_head.weight"
NORMAL_METADATA = {"format": "pt"}
_D = re.compile(r"^model\.layers\.\d+\.attn\.D$")
FIX = "use a complete Gated DeltaNet checkpoint (fla GatedDeltaNetForCausalLM) whose config.json matches its weights"


def detect_layout(names: Iterable[str]) -> str | None:
    """The layout, when the names are Gated DeltaNet's (an ``attn.b_proj`` and an ``attn.A_log``:
    the delta rule's write strength and decay); None otherwise."""
    names = set(names)
    if not any(n.endswith(".attn.b_proj.weight") for n in names) or not any(n.endswith(".attn.A_log") for n in names):
        return None
    if HEAD not in names:
        return TIED
    if any(_D.match(n) for n in names):
        return ZERO_D
    return FLA


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_d(name: str, t: Any, where: str | Path) -> None:
    """The stated rule for an ``attn.D``: all zero, else refused."""
    if not t.is_meta and bool((t != 0).any()):
        what = (f"is not all zero (max |D| {float(t.abs().max()):.3g}): fla's Gated DeltaNet has no D skip term, so a "
                "nonzero D would change the model")
        raise PipelineError(where, what if where == name else f"tensor {name} {what}",
                            "use a checkpoint that fla's GatedDeltaNetForCausalLM loads (its attn.D all zero or absent)")


def normalize(sd: Mapping[str, Any], geom: Geometry, where: str | Path) -> dict[str, Any]:
    """Any layout -> the normal form (normal_shapes order), every name and shape checked."""
    expected = normal_shapes(geom)
    tensors: dict[str, Any] = {}
    for name, t in sd.items():
        if _D.match(name):
            check_d(name, t, where)
            continue
        tensors[name] = t
    if HEAD not in tensors and EMBED in tensors:
        if not geom.tie_embeddings:
            raise PipelineError(where, f"tensor {HEAD} is missing (expected shape {_shape(expected[HEAD])}) and "
                                "config.json does not tie it to the embedding", FIX)
        tensors[HEAD] = tensors[EMBED].clone()
    elif geom.tie_embeddings and HEAD in tensors and EMBED in tensors:
        head, emb = tensors[HEAD], tensors[EMBED]
        if not head.is_meta and not emb.is_meta and (head.shape != emb.shape or not bool((head == emb).all())):
            raise PipelineError(where, f"tensor {HEAD} differs from the tied embedding {EMBED} (config.json ties them)",
                                "set tie_word_embeddings false in config.json if the head is its own tensor")
    for name, shape in expected.items():
        if name not in tensors:
            raise PipelineError(where, f"tensor {name} is missing (expected shape {_shape(shape)})", FIX)
    extra = [n for n in tensors if n not in expected]
    if extra:
        raise PipelineError(where, f"unexpected tensor {extra[0]} (shape {_shape(tensors[extra[0]].shape)}; "
                            f"{len(extra)} unexpected in all)", FIX)
    out: dict[str, Any] = {}
    for name, shape in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(shape):
            raise PipelineError(where, f"tensor {name} has shape {_shape(t.shape)}, expected {_shape(shape)}",
                                "check that config.json matches the weights")
        out[name] = t if t.is_meta else t.contiguous()
    return out


def original_name(layout: str, normal: str) -> str:
    """The name a checkpoint in ``layout`` stores the normal-form tensor ``normal`` under: the
    same in every layout (a tied checkpoint's head is its embedding)."""
    return EMBED if layout == TIED and normal == HEAD else normal


def normal_parts(layout: str, name: str, tensor: Any) -> list[tuple[str, Any]]:
    """What one stored tensor becomes: itself; a zero ``attn.D`` nothing; a tied checkpoint's
    embedding also the head."""
    if _D.match(name):
        check_d(name, tensor, name)
        return []
    if layout == TIED and name == EMBED:
        return [(EMBED, tensor), (HEAD, tensor)]
    return [(name, tensor)]


def write_layout(sd: Mapping[str, Any], out_dir: Path, layout: str, geom: Geometry) -> Path:
    """Normal-form weights written in ``layout`` with fla's config.json; returns the weights file.
    ``fla-zero-d`` adds an all-zero ``attn.D`` [Hv] per layer; ``fla-tied`` needs a tied geometry
    (lm_head equal to the embedding) and omits the head."""
    import safetensors.torch
    import torch

    if layout not in LAYOUTS:
        raise ValueError(f"unknown Gated DeltaNet layout {layout!r} (use one of {', '.join(LAYOUTS)})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sd = normalize(sd, geom, "normal form")
    tensors = dict(sd)
    if layout == TIED:
        if not geom.tie_embeddings or not torch.equal(sd[HEAD], sd[EMBED]):
            raise ValueError("the fla-tied layout needs a tied geometry (tie_embeddings, lm_head equal to the embedding)")
        del tensors[HEAD]
    if layout == ZERO_D:
        for i in range(geom.layers):
            tensors[f"model.layers.{i}.attn.D"] = torch.zeros(geom.hv)
    path = out_dir / WEIGHT_FILE
    safetensors.torch.save_file(tensors, str(path), metadata=dict(NORMAL_METADATA))
    (out_dir / "config.json").write_text(json.dumps(config_json(geom), indent=2) + "\n")
    return path


def write_streamed(tensors: Iterable[tuple[str, Any]], out_dir: Path, layout: str, geom: Geometry) -> Path:
    """What :func:`write_layout` writes (the same bytes), from normal-form (name, tensor) pairs in
    normal_shapes order, holding one tensor at a time: a synthetic 1.3B (5.9 GB) is written in the
    memory of its largest tensor."""
    import torch

    from recurrent_coreai.util.safetensors_stream import save_streamed

    if layout not in LAYOUTS:
        raise ValueError(f"unknown Gated DeltaNet layout {layout!r} (use one of {', '.join(LAYOUTS)})")
    if layout == TIED and not geom.tie_embeddings:
        raise ValueError("the fla-tied layout needs a tied geometry (tie_embeddings, lm_head equal to the embedding)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = {n: (torch.float32, s) for n, s in normal_shapes(geom).items() if not (layout == TIED and n == HEAD)}
    zeros = {f"model.layers.{i}.attn.D": torch.zeros(geom.hv) for i in range(geom.layers)} if layout == ZERO_D else {}
    specs.update({n: (torch.float32, tuple(t.shape)) for n, t in zeros.items()})

    def pairs():
        for name, t in tensors:
            if name in specs:
                yield name, t.float().contiguous()
        yield from zeros.items()

    path = out_dir / WEIGHT_FILE
    save_streamed(path, specs, pairs(), NORMAL_METADATA)
    (out_dir / "config.json").write_text(json.dumps(config_json(geom), indent=2) + "\n")
    return path


def read_dir(src: Path) -> tuple[Geometry, dict[str, Any], str]:
    """(geometry, normal-form weights, layout) of a directory written by :func:`write_layout` (a small
    reader for tests; the pipeline's reader does the same)."""
    import safetensors.torch

    src = Path(src)
    geom = geometry_from_config(json.loads((src / "config.json").read_text()), src / "config.json")
    sd = safetensors.torch.load_file(str(src / WEIGHT_FILE))
    return geom, normalize(sd, geom, src / WEIGHT_FILE), detect_layout(sd)
