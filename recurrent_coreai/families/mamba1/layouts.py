"""Mamba-1 checkpoint layouts and their normalisation to ONE normal form.

* ``hf`` (the normal form): transformers ``MambaForCausalLM`` / ``FalconMambaForCausalLM``,
  ``model.safetensors`` + config.json (``model_type: mamba | falcon_mamba``):
  ``backbone.embeddings.weight``, per layer ``backbone.layers.{i}.norm.weight`` and
  ``backbone.layers.{i}.mixer.{in_proj.weight, conv1d.weight, conv1d.bias, x_proj.weight,
  dt_proj.weight, dt_proj.bias, A_log, D, out_proj.weight}``, ``backbone.norm_f.weight``,
  ``lm_head.weight`` (absent when ``tie_word_embeddings``). Falcon Mamba's B/C/dt norms have no
  stored weight (transformers keeps a non-persistent buffer of ones).
* ``mamba-ssm``: the original ``state-spaces/mamba-*`` release, ``pytorch_model.bin`` (a pickled
  state dict, read with ``torch.load(weights_only=True)``) + mamba_ssm's config.json
  (``d_model``, ``n_layer``, ``ssm_cfg`` ...): the same names except ``backbone.embedding.weight``
  (singular; transformers' load hook renames it), and ``lm_head.weight`` stored beside it, the
  same storage (the head is always tied there; mamba_ssm's ``save_pretrained`` saves ``state_dict()``).

The normal form always holds ``lm_head.weight``: a tied head is materialised as a copy of the
embedding (so a tied model's normal form has the table twice; a head stored beside a tied
embedding must equal it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from recurrent_coreai.families.mamba1.geometry import (Geometry, geometry_from_config, hf_config, mamba_ssm_config,
                                                        normal_shapes)
from recurrent_coreai.util.errors import PipelineError

HF, MAMBA_SSM = "hf", "mamba-ssm"
LAYOUTS = (HF, MAMBA_SSM)
WEIGHT_FILES = {HF: "model.safetensors", MAMBA_SSM: "pytorch_model.bin"}
EMBED = {HF: "backbone.embeddings.weight", MAMBA_SSM: "backbone.embedding.weight"}
HEAD = "lm_head.weight"
NORMAL_EMBED = EMBED[HF]
NORMAL_METADATA = {"format": "pt"}
TIED_FIX = "set tie_embeddings/tie_word_embeddings false in config.json if the head is its own tensor"


def detect_layout(names: Iterable[str]) -> str | None:
    """``hf`` or ``mamba-ssm`` when the names are Mamba-1's (a ``mixer.dt_proj`` and a
    ``mixer.x_proj``: Mamba-2 has a ``dt_bias`` and no x_proj), else None."""
    names = set(names)
    if not any(n.startswith("backbone.layers.") and n.endswith(".mixer.dt_proj.weight") for n in names) or \
            not any(n.startswith("backbone.layers.") and n.endswith(".mixer.x_proj.weight") for n in names):
        return None
    if EMBED[MAMBA_SSM] in names and EMBED[HF] not in names:
        return MAMBA_SSM
    return HF


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _where_fix(geom: Geometry) -> str:
    return "use a complete Mamba-1 checkpoint whose config.json matches its weights"


def normalize(sd: Mapping[str, Any], geom: Geometry, where: str | Path) -> dict[str, Any]:
    """Either layout -> the normal form (normal_shapes order), every name and shape checked. Works
    on meta tensors (the tied head's equality check is then skipped)."""
    layout = detect_layout(sd) or HF
    embed = EMBED[layout]
    expected = normal_shapes(geom)
    fix = _where_fix(geom)
    renamed: dict[str, Any] = {}
    for name, t in sd.items():
        renamed[NORMAL_EMBED if name == embed else name] = t
    if HEAD not in renamed and geom.tie_embeddings and NORMAL_EMBED in renamed:
        renamed[HEAD] = renamed[NORMAL_EMBED].clone()   # materialised: the normal form holds both
    elif geom.tie_embeddings and HEAD in renamed and NORMAL_EMBED in renamed:
        head, emb = renamed[HEAD], renamed[NORMAL_EMBED]
        if not head.is_meta and not emb.is_meta and (head.shape != emb.shape or not bool((head == emb).all())):
            raise PipelineError(where, f"tensor {HEAD} differs from the tied embedding {embed} "
                                "(config.json ties them)", TIED_FIX)
        renamed[HEAD] = emb.clone() if head is emb else head
    for name, shape in expected.items():
        if name not in renamed:
            stored = embed if name == NORMAL_EMBED else name
            raise PipelineError(where, f"tensor {stored} is missing (expected shape {_shape(shape)})", fix)
    extra = [n for n in renamed if n not in expected]
    if extra:
        raise PipelineError(where, f"unexpected tensor {extra[0]} (shape {_shape(renamed[extra[0]].shape)}; "
                            f"{len(extra)} unexpected in all)", fix)
    out: dict[str, Any] = {}
    for name, shape in expected.items():
        t = renamed[name]
        if tuple(t.shape) != tuple(shape):
            stored = embed if name == NORMAL_EMBED else name
            if name.endswith("mixer.x_proj.weight") and len(t.shape) == 2 and t.shape[1] == shape[1]:
                g = geom
                raise PipelineError(where, f"tensor {stored} has {t.shape[0]} output rows, but config.json implies "
                                    f"dt_rank + 2*d_state = {g.dt_rank} + 2*{g.d_state} = {shape[0]}",
                                    "fix time_step_rank/state_size in config.json to match the weights")
            raise PipelineError(where, f"tensor {stored} has shape {_shape(t.shape)}, expected {_shape(shape)}",
                                "check that config.json matches the weights")
        out[name] = t if t.is_meta else t.contiguous()
    return out


def original_name(layout: str, normal: str) -> str:
    """The name a checkpoint in ``layout`` stores the normal-form tensor ``normal`` under (messages
    about a file name its own tensors): the embedding's differs."""
    return EMBED[layout] if normal == NORMAL_EMBED else normal


def normal_parts(layout: str, name: str, tensor: Any) -> list[tuple[str, Any]]:
    """One stored tensor's normal-form name (the embedding's rename). Streaming needs more than
    this (:func:`normal_stream`): whether the head is tied is in config.json, not in a tensor's name."""
    return [(NORMAL_EMBED if name == EMBED[MAMBA_SSM] else name, tensor)]


def normal_stream(layout: str, geom: Geometry, names: Iterable[str]) -> Callable[[str, Any], list[tuple[str, Any]]]:
    """What :func:`normalize` does, one stored tensor at a time (the reader's streamed write): the
    embedding's rename; a tied head the file leaves out written from the embedding; a tied head
    stored beside the embedding checked equal to it when the second of the two comes (only the
    first is held), then written as it is stored (what normalize keeps). Every name and shape was
    checked before (normalize on meta tensors)."""
    embed, tied, head_stored = EMBED[layout], geom.tie_embeddings, HEAD in set(names)
    held: dict[str, Any] = {}

    def parts(name: str, tensor: Any) -> list[tuple[str, Any]]:
        normal = NORMAL_EMBED if name == embed else name
        if tied and not head_stored and normal == NORMAL_EMBED:
            return [(NORMAL_EMBED, tensor), (HEAD, tensor)]
        if tied and head_stored and normal in (NORMAL_EMBED, HEAD):
            other = HEAD if normal == NORMAL_EMBED else NORMAL_EMBED
            if other not in held:
                held[normal] = tensor
            else:
                first = held.pop(other)
                if first.shape != tensor.shape or not bool((first == tensor).all()):
                    what = (f"differs from the tied embedding {embed}" if normal == HEAD
                            else f"differs from the tied head {HEAD}")
                    raise PipelineError(name, f"{what} (config.json ties them)", TIED_FIX)
        return [(normal, tensor)]

    return parts


def write_streamed(tensors: Iterable[tuple[str, Any]], out_dir: Path, geom: Geometry) -> Path:
    """What :func:`write_layout` writes in the ``hf`` layout (the same bytes), from normal-form
    (name, tensor) pairs in normal_shapes order, holding one tensor at a time (a tied head is left
    out, as transformers saves it: the pairs stop before it)."""
    import torch

    from recurrent_coreai.util.safetensors_stream import save_streamed

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = {n: (torch.float32, s) for n, s in normal_shapes(geom).items() if not (geom.tie_embeddings and n == HEAD)}

    def pairs():
        left = set(specs)
        for name, t in tensors:
            if name in left:
                left.discard(name)
                yield name, t.contiguous()
            del t
            if not left:
                return  # a tied head is never drawn into a copy only to be dropped

    path = out_dir / WEIGHT_FILES[HF]
    save_streamed(path, specs, pairs(), NORMAL_METADATA)
    (out_dir / "config.json").write_text(json.dumps(hf_config(geom), indent=2) + "\n")
    return path


def write_layout(sd: Mapping[str, Any], out_dir: Path, layout: str, geom: Geometry) -> Path:
    """Normal-form weights written in ``layout`` with its config.json; returns the weights file.
    A tied geometry (``tie_embeddings``) needs lm_head equal to the embedding: ``hf`` then omits
    lm_head.weight (as transformers saves a tied model), ``mamba-ssm`` stores it as the embedding's
    own tensor (one storage in the pickle, as mamba_ssm's save_pretrained)."""
    import torch

    if layout not in LAYOUTS:
        raise ValueError(f"unknown Mamba-1 layout {layout!r} (use one of {', '.join(LAYOUTS)})")
    cfg = hf_config(geom) if layout == HF else mamba_ssm_config(geom)   # refused before anything is written
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sd = normalize(sd, geom, "normal form")
    emb = sd[NORMAL_EMBED]
    if geom.tie_embeddings and not torch.equal(sd[HEAD], emb):
        raise ValueError("a tied geometry needs lm_head.weight equal to the embedding")
    path = out_dir / WEIGHT_FILES[layout]
    if layout == HF:
        import safetensors.torch

        tensors = {n: t for n, t in sd.items() if not (geom.tie_embeddings and n == HEAD)}
        safetensors.torch.save_file(tensors, str(path), metadata=dict(NORMAL_METADATA))
    else:
        tensors = {(EMBED[MAMBA_SSM] if n == NORMAL_EMBED else n): t for n, t in sd.items()}
        if geom.tie_embeddings:
            tensors[HEAD] = tensors[EMBED[MAMBA_SSM]]
        torch.save(tensors, path)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def read_dir(src: Path) -> tuple[Geometry, dict[str, Any], str]:
    """(geometry, normal-form weights, layout) of a directory written by :func:`write_layout`
    (a small reader for tests and tools; the pipeline's generic reader does the same)."""
    import torch

    src = Path(src)
    cfg_path = src / "config.json"
    geom = geometry_from_config(json.loads(cfg_path.read_text()), cfg_path)
    if (src / WEIGHT_FILES[HF]).is_file():
        import safetensors.torch

        sd = safetensors.torch.load_file(str(src / WEIGHT_FILES[HF]))
        where = src / WEIGHT_FILES[HF]
    else:
        where = src / WEIGHT_FILES[MAMBA_SSM]
        sd = torch.load(where, map_location="cpu", weights_only=True)
    layout = detect_layout(sd)
    if layout is None:
        raise PipelineError(where, "holds no Mamba-1 tensors (no backbone.layers.*.mixer.dt_proj/x_proj)",
                            "point the source at a Mamba-1 checkpoint")
    return geom, normalize(sd, geom, where), layout
