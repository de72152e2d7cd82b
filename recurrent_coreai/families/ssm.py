"""What the Mamba-style selective-SSM families (families/mamba1, families/mamba2) share.

Both hold their weights under the same transformers names (``backbone.embeddings``,
``backbone.layers.{i}.{norm, mixer.*}``, ``backbone.norm_f``, ``lm_head``) in the same two
checkpoint layouts (``hf`` and the original ``mamba-ssm`` pickle, whose only rename is the
embedding), carry the same two states (the conv window ``convState`` and ``ssmState``), run the
same outer loop around their layers and draw their shared tensors the same way. Only the mixer
differs (Mamba-1's x_proj/dt_proj per channel, Mamba-2's heads and groups): that stays in each
family, passed in here where a shared step needs it.

A seam module beside base/hparams/draws (pyproject.toml's independence contract ignores imports
of it), so it imports no family. Torch is imported inside the functions that use it: the
families' geometry and layouts (and the registry's ``families.get``) load without it.
"""

from __future__ import annotations

import abc
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

from recurrent_coreai.families import base
from recurrent_coreai.families.hparams import REQUIRED, HParams, json_type
from recurrent_coreai.util.errors import PipelineError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from recurrent_coreai.families.draws import Draws

# --- geometry ----------------------------------------------------------------------------------


def shape_values(shape: object, keys: Mapping[str, tuple[type, object]], label: str, where: str | Path) -> dict:
    """config.yaml's ``source.shape`` checked against ``keys`` (name -> (type, default or
    REQUIRED)): every key known, the required ones given, each value of its type; the defaults
    filled in (ints stay ints, numbers become floats). ``label`` names the family in messages."""
    if not isinstance(shape, Mapping):
        raise PipelineError(where, f"source.shape is a {json_type(shape)}, not a mapping",
                            f"give the keys {', '.join(keys)}")
    unknown = sorted(set(shape) - set(keys))
    if unknown:
        raise PipelineError(where, f"unknown {label} shape key {unknown[0]!r}", f"use only {', '.join(keys)}")
    values = {}
    for key, (typ, default) in keys.items():
        if key not in shape:
            if default is REQUIRED:
                raise PipelineError(where, f"{label} shape key {key!r} is missing",
                                    f"give {', '.join(k for k, (_, d) in keys.items() if d is REQUIRED)}")
            values[key] = default
            continue
        v = shape[key]
        ok = (isinstance(v, bool) if typ is bool else
              (isinstance(v, int) and not isinstance(v, bool)) if typ is int else
              (isinstance(v, (int, float)) and not isinstance(v, bool)))
        if not ok:
            raise PipelineError(where, f"shape key {key} must be {'a boolean' if typ is bool else 'an integer' if typ is int else 'a number'}, "
                                f"got {v!r}", f"fix source.shape.{key}")
        values[key] = float(v) if typ is float else v
    return values


def check_fields(g: Any, where: str | Path, flags: tuple[str, ...] = ("tie_embeddings",)) -> None:
    """A geometry dataclass's fields: ``flags`` true or false, every other one a positive finite
    number, an integer where the field is declared int."""
    from dataclasses import fields

    for f in fields(g):
        value = getattr(g, f.name)
        if f.name in flags:
            if not isinstance(value, bool):
                raise PipelineError(where, f"{f.name} must be true or false, got {value!r}", "fix the model shape")
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise PipelineError(where, f"{f.name} must be positive, got {value!r}", "fix the model shape")
        if f.type in ("int", int) and not isinstance(value, int):
            raise PipelineError(where, f"{f.name} must be an integer, got {value!r}", "fix the model shape")


def require_plain_hf_mixer(r: HParams) -> None:
    """transformers' settings both ports leave out: projection biases, a conv without bias,
    another activation."""
    r.require("use_bias", lambda v: v is False, False, "use_bias false (no in_proj/out_proj bias)")
    r.require("use_conv_bias", lambda v: v is True, True, "use_conv_bias true")
    r.require("hidden_act", lambda v: v in ("silu", "swish"), "silu", 'hidden_act "silu"')


# mamba_ssm's MambaConfig (MambaLMHeadModel's config.json, either layer)
MAMBA_SSM_KEYS = {"d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx", "attn_cfg",
                  "rms_norm", "residual_in_fp32", "fused_add_norm", "pad_vocab_size_multiple", "tie_embeddings",
                  "norm_epsilon"}


def require_plain_mamba_ssm(r: HParams) -> None:
    """mamba_ssm's MixerModel as both ports run it: only its keys, no MLP, no attention layers,
    RMS norms."""
    r.only(MAMBA_SSM_KEYS, "mamba_ssm config key")
    r.require("d_intermediate", lambda v: v == 0, 0, "d_intermediate 0 (no MLP)")
    r.require("attn_layer_idx", lambda v: v == [], [], "attn_layer_idx [] (no attention layers)")
    r.require("rms_norm", lambda v: v is True, True, "rms_norm true")


def mamba_ssm_vocab(r: HParams) -> int:
    """``vocab_size`` padded up to ``pad_vocab_size_multiple`` (MambaLMHeadModel pads the table)."""
    vocab = r.whole("vocab_size")
    multiple = r.whole("pad_vocab_size_multiple", default=8)  # MambaConfig's default
    return vocab + (-vocab) % multiple


STATE_NAMES = ("convState", "ssmState")  # the buffers every function reads and writes once


def state_specs(g: Any, conv_width: int, conv_what: str, ssm_shape: tuple[int, ...],
                ssm_what: str) -> list[base.StateSpec]:
    """The bundle's states, in registration order: the conv window [L,1,conv_width,K] (newest
    last) and the SSM state [L,1,*ssm_shape]."""
    conv, ssm = STATE_NAMES
    return [base.StateSpec(conv, (g.layers, 1, conv_width, g.conv_kernel), conv_what),
            base.StateSpec(ssm, (g.layers, 1, *ssm_shape), ssm_what)]


def normal_shapes(g: Any, in_width: int, conv_width: int,
                  mixer: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The normal form (transformers names, lm_head always present), in file order: per layer the
    block norm, in_proj [in_width, C], the conv [conv_width, 1, K] and its bias, the family's own
    ``mixer`` tensors (names after ``mixer.``, in order), out_proj [C, I]."""
    C = g.hidden
    shapes: dict[str, tuple[int, ...]] = {"backbone.embeddings.weight": (g.vocab, C)}
    for i in range(g.layers):
        p = f"backbone.layers.{i}."
        shapes[p + "norm.weight"] = (C,)
        shapes[p + "mixer.in_proj.weight"] = (in_width, C)
        shapes[p + "mixer.conv1d.weight"] = (conv_width, 1, g.conv_kernel)
        shapes[p + "mixer.conv1d.bias"] = (conv_width,)
        for name, shape in mixer.items():
            shapes[p + "mixer." + name] = shape
        shapes[p + "mixer.out_proj.weight"] = (C, g.intermediate)
    shapes["backbone.norm_f.weight"] = (C,)
    shapes["lm_head.weight"] = (g.vocab, C)
    return shapes


# --- the family seam ---------------------------------------------------------------------------
class Family(base.Family):
    """The seam methods Mamba-1 and Mamba-2 implement alike, each over its own geometry and layouts
    modules and Geometry class (``geometry_module``, ``layouts_module``, ``geometry_class``). A
    subclass says what else it is (names, roles, shapes, card) and what of ``geom`` the tensor
    shapes do not hold (``geom_not_in_shapes``: why ``write_layout`` needs it)."""
    geometry_module: Any
    layouts_module: Any
    geometry_class: type
    geom_not_in_shapes: str = ""

    # --- geometry ------------------------------------------------------------------------
    def geometry_from_shape(self, shape: Mapping, where: str | Path) -> Any:
        return self.geometry_module.geometry_from_shape(shape, where)

    def geometry_from_dict(self, d: Mapping) -> Any:
        return self.geometry_class(**dict(d)).check("geometry record")

    def parameter_count(self, geom: Any) -> int:
        """The model's own parameters: a tied head is the embedding, counted once (the normal
        form holds it twice)."""
        return super().parameter_count(geom) - (geom.vocab * geom.hidden if geom.tie_embeddings else 0)

    def tied_linears(self, geom: Any) -> dict[str, str]:
        """Decode-module linears whose weight is tied to another tensor: a tied head is the embedding
        table (one fp16 copy in the bundle serves the lookup and the head, so roles keep it)."""
        return {"lm_head": "backbone.embeddings.weight"} if geom.tie_embeddings else {}

    def config_json(self, geom: Any) -> dict:
        return self.geometry_module.hf_config(geom)   # the normal form's (HF) config.json, not mamba_ssm's

    # --- checkpoints ---------------------------------------------------------------------
    def streams(self, layout: str) -> bool:
        """Neither layout normalises by its tensor names alone: whether lm_head is tied (materialised
        from the embedding, or checked equal to it) is in config.json. Both stream with the geometry
        (:meth:`normal_stream`); a synthetic source is written in its layout and normalised so."""
        return False

    def normal_stream(self, layout: str, geom: Any, names):
        """Both layouts, one tensor at a time with the geometry (layouts.normal_stream)."""
        return self.layouts_module.normal_stream(layout, geom, names) if layout in self.layouts else None

    def write_synthetic(self, geom: Any, seed: int, out_dir: Path, layout: str) -> Path:
        """``hf``: written one tensor at a time (the bytes write_layout gives); ``mamba-ssm``: a
        pickle, written whole by torch.save (write_layout)."""
        if layout == self.layouts_module.HF:
            return self.layouts_module.write_streamed(self.synthetic_tensors(geom, seed), out_dir, geom)
        return super().write_synthetic(geom, seed, out_dir, layout)

    def write_layout(self, sd: Mapping[str, Any], out_dir: Path, layout: str, geom: Any = None) -> Path:
        """As the seam says, plus ``geom``: config.json cannot be written from the weights alone
        (``geom_not_in_shapes`` says what of it the tensor shapes do not hold)."""
        if geom is None:
            raise TypeError(f"{self.name} write_layout needs geom= ({self.geom_not_in_shapes} are not in the "
                            "tensor shapes)")
        return self.layouts_module.write_layout(sd, out_dir, layout, geom)


# --- checkpoint layouts ------------------------------------------------------------------------
HF, MAMBA_SSM = "hf", "mamba-ssm"
LAYOUTS = (HF, MAMBA_SSM)
WEIGHT_FILES = {HF: "model.safetensors", MAMBA_SSM: "pytorch_model.bin"}
EMBED = {HF: "backbone.embeddings.weight", MAMBA_SSM: "backbone.embedding.weight"}
HEAD = "lm_head.weight"
NORMAL_EMBED = EMBED[HF]
NORMAL_METADATA = {"format": "pt"}
TIED_FIX = "set tie_embeddings/tie_word_embeddings false in config.json if the head is its own tensor"


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


@dataclass(frozen=True)
class Layouts:
    """One family's ``hf`` and ``mamba-ssm`` layouts: the normal form is ``hf``'s names with
    lm_head always held (a tied head materialised as a copy of the embedding; a head stored beside
    a tied embedding must equal it). The family gives what differs: its name, how its tensors are
    told apart from the other family's, its shapes and config.json writers, and a clearer message
    for the one tensor whose row count a config.json mismatch shows in."""

    label: str                                          # "Mamba-1": in messages
    marker: str                                         # the tensors that tell the family, in messages
    is_family: Callable[[set[str]], bool]               # the stored names are this family's
    normal_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    hf_config: Callable[[Any], dict]
    mamba_ssm_config: Callable[[Any], dict]             # raises ValueError where the layout cannot hold g
    geometry_from_config: Callable[[Any, Any], Any]
    mismatch: Callable[[str, str, Any, tuple, Any, Any], PipelineError | None]  # (name, stored, t, shape, g, where)

    def detect_layout(self, names: Iterable[str]) -> str | None:
        names = set(names)
        if not self.is_family(names):
            return None
        if EMBED[MAMBA_SSM] in names and EMBED[HF] not in names:
            return MAMBA_SSM
        return HF

    def normalize(self, sd: Mapping[str, Any], geom: Any, where: str | Path) -> dict[str, Any]:
        """Either layout -> the normal form (normal_shapes order), every name and shape checked.
        Works on meta tensors (the tied head's equality check is then skipped)."""
        layout = self.detect_layout(sd) or HF
        embed = EMBED[layout]
        expected = self.normal_shapes(geom)
        fix = f"use a complete {self.label} checkpoint whose config.json matches its weights"
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
                raise (self.mismatch(name, stored, t, shape, geom, where) or
                       PipelineError(where, f"tensor {stored} has shape {_shape(t.shape)}, expected {_shape(shape)}",
                                     "check that config.json matches the weights"))
            out[name] = t if t.is_meta else t.contiguous()
        return out

    def write_layout(self, sd: Mapping[str, Any], out_dir: Path, layout: str, geom: Any) -> Path:
        """Normal-form weights written in ``layout`` with its config.json; returns the weights file.
        A tied geometry (``tie_embeddings``) needs lm_head equal to the embedding: ``hf`` then omits
        lm_head.weight (as transformers saves a tied model), ``mamba-ssm`` stores it as the
        embedding's own tensor (one storage in the pickle, as mamba_ssm's save_pretrained)."""
        import torch

        if layout not in LAYOUTS:
            raise ValueError(f"unknown {self.label} layout {layout!r} (use one of {', '.join(LAYOUTS)})")
        cfg = self.hf_config(geom) if layout == HF else self.mamba_ssm_config(geom)  # refused before anything is written
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        sd = self.normalize(sd, geom, "normal form")
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

    def write_streamed(self, tensors: Iterable[tuple[str, Any]], out_dir: Path, geom: Any) -> Path:
        """What :meth:`write_layout` writes in the ``hf`` layout (the same bytes), from normal-form
        (name, tensor) pairs in normal_shapes order, holding one tensor at a time (a tied head is
        left out, as transformers saves it: the pairs stop before it)."""
        import torch

        from recurrent_coreai.util.safetensors_stream import save_streamed

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        specs = {n: (torch.float32, s) for n, s in self.normal_shapes(geom).items()
                 if not (geom.tie_embeddings and n == HEAD)}

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
        (out_dir / "config.json").write_text(json.dumps(self.hf_config(geom), indent=2) + "\n")
        return path

    def read_dir(self, src: Path) -> tuple[Any, dict[str, Any], str]:
        """(geometry, normal-form weights, layout) of a directory written by :meth:`write_layout`
        (a small reader for tests and tools; the pipeline's generic reader does the same)."""
        import torch

        src = Path(src)
        cfg_path = src / "config.json"
        geom = self.geometry_from_config(json.loads(cfg_path.read_text()), cfg_path)
        if (src / WEIGHT_FILES[HF]).is_file():
            import safetensors.torch

            sd = safetensors.torch.load_file(str(src / WEIGHT_FILES[HF]))
            where = src / WEIGHT_FILES[HF]
        else:
            where = src / WEIGHT_FILES[MAMBA_SSM]
            sd = torch.load(where, map_location="cpu", weights_only=True)
        layout = self.detect_layout(sd)
        if layout is None:
            raise PipelineError(where, f"holds no {self.label} tensors (no backbone.layers.*.mixer.{self.marker})",
                                f"point the source at a {self.label} checkpoint")
        return geom, self.normalize(sd, geom, where), layout


def original_name(layout: str, normal: str) -> str:
    """The name a checkpoint in ``layout`` stores the normal-form tensor ``normal`` under (messages
    about a file name its own tensors): the embedding's differs."""
    return EMBED[layout] if normal == NORMAL_EMBED else normal


def normal_parts(layout: str, name: str, tensor: Any) -> list[tuple[str, Any]]:
    """One stored tensor's normal-form name (the embedding's rename). Streaming needs more than
    this (:func:`normal_stream`): whether the head is tied is in config.json, not in a tensor's name."""
    return [(NORMAL_EMBED if name == EMBED[MAMBA_SSM] else name, tensor)]


def normal_stream(layout: str, geom: Any, names: Iterable[str]) -> Callable[[str, Any], list[tuple[str, Any]]]:
    """What :meth:`Layouts.normalize` does, one stored tensor at a time (the reader's streamed
    write): the embedding's rename; a tied head the file leaves out written from the embedding; a
    tied head stored beside the embedding checked equal to it when the second of the two comes
    (only the first is held), then written as it is stored (what normalize keeps). Every name and
    shape was checked before (normalize on meta tensors)."""
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


# --- synthetic weights -------------------------------------------------------------------------
LM_HEAD_GAIN = 3.0        # base logit std (norm_f output has unit RMS)
LM_HEAD_ROW_SPREAD = 0.4  # log-normal spread of lm_head row norms
DT_MIN, DT_MAX = 1e-3, 1e-1
A_RANGE = (1.0, 16.0)


def lm_head(shape, g: Any, d: "Draws") -> "torch.Tensor":
    """``(d.normal(shape, gain, exact=True) * rows).float()`` with ``rows = exp(d.normal((V, 1),
    spread, exact=True))``, the same values, made RANDN_CHUNK values at a time: never a float64
    table (a 50288 x 2048 head would be two 824 MB float64 temporaries beside its 412 MB). The
    draws are calls of RANDN_CHUNK values, then one of the rest (families/draws.py: what one call
    draws); each value is multiplied by its row's factor in float64 and cast once, as the whole."""
    import torch

    from recurrent_coreai.families.draws import RANDN_CHUNK

    rows = torch.exp(d.normal((shape[0], 1), LM_HEAD_ROW_SPREAD, exact=True)).reshape(-1)
    out = torch.empty(tuple(shape), dtype=torch.float32)
    flat, at, width = out.view(-1), 0, shape[1]
    while at < flat.numel():
        n = flat.numel() - at if flat.numel() - at < 2 * RANDN_CHUNK else RANDN_CHUNK
        w = d.normal((n,), LM_HEAD_GAIN / math.sqrt(g.hidden), exact=True)
        flat[at:at + n] = w.mul_(rows[torch.arange(at, at + n) // width])  # the one cast, as (w * rows).float()
        at += n
    return out


def dt_bias(shape, d: "Draws") -> "torch.Tensor":
    """log(e^dt - 1) (the inverse of the step size's activation log(1 + e^x)), dt log-uniform in
    [DT_MIN, DT_MAX]: the step size's bias (Mamba-1's dt_proj.bias per channel, Mamba-2's dt_bias
    per head). The op's name is not written here: coreai doctor's source lint reads this file (it
    holds traced code too) and takes the word for the overflowing op."""
    import torch

    dt = d.log_uniform(shape, DT_MIN, DT_MAX, exact=True)
    return (dt + torch.log(-torch.expm1(-dt))).float()   # the activation's inverse


def init(name: str, shape: tuple[int, ...], g: Any, d: "Draws") -> "torch.Tensor":
    """A tensor both families hold, drawn (the family draws its own mixer tensors first)."""
    import torch

    if name == "backbone.embeddings.weight":
        return lm_head(shape, g, d) if g.tie_embeddings else d.normal(shape, 1.0)
    if name == "lm_head.weight":
        return lm_head(shape, g, d)
    if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
        return d.uniform(shape, 0.8, 1.2)
    if name.endswith("mixer.in_proj.weight"):
        return d.normal(shape, 1.0 / math.sqrt(shape[1]))
    if name.endswith("mixer.conv1d.weight"):
        bound = 1.0 / math.sqrt(shape[-1])
        return d.uniform(shape, -bound, bound)
    if name.endswith("mixer.conv1d.bias"):
        return d.uniform(shape, -0.1, 0.1)
    if name.endswith("mixer.A_log"):
        return torch.log(d.uniform(shape, *A_RANGE, exact=True)).float()
    if name.endswith("mixer.D"):
        return d.uniform(shape, 0.5, 1.5)
    if name.endswith("mixer.out_proj.weight"):
        return d.normal(shape, 0.5 / math.sqrt(shape[1]))
    raise KeyError(name)


def synthetic_tensors(shapes: Mapping[str, tuple[int, ...]], g: Any, seed: int,
                      draw: Callable[[str, tuple[int, ...], Any, "Draws"], "torch.Tensor"]
                      ) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Every tensor of ``shapes`` (normal_shapes order) drawn by ``draw`` from one generator; a
    tied geometry's lm_head is a copy of the embedding."""
    from recurrent_coreai.families.draws import Draws

    d = Draws(seed)
    emb = None
    for name, shape in shapes.items():
        if name == "lm_head.weight" and g.tie_embeddings:
            yield name, emb.clone()
            continue
        t = draw(name, shape, g, d).contiguous()
        if name == "backbone.embeddings.weight" and g.tie_embeddings:
            emb = t
        yield name, t


# --- the reference -----------------------------------------------------------------------------


def rms_norm(x: "torch.Tensor", weight, eps: float) -> "torch.Tensor":
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Reference(base.Reference):
    """The oracle's outer loop over the normal-form weights as given (the checkpoint reader checked
    them): embedding, the family's :meth:`layer` per layer, final norm, head. The state is
    ``{"conv": [L, conv_width, K], "ssm": [L, ...]}``; the bundle's adds the batch axis."""

    @abc.abstractmethod
    def layer(self, i: int, x: "torch.Tensor", state: dict) -> "torch.Tensor":
        """The residual stream after layer ``i``; the layer's slices of ``state`` updated in place."""

    def advance(self, token: int, state: dict) -> "torch.Tensor":
        x = self.w["backbone.embeddings.weight"][int(token)]
        for i in range(self.g.layers):
            x = self.layer(i, x, state)
        return x

    def logits(self, x: "torch.Tensor") -> "torch.Tensor":
        return self.w["lm_head.weight"] @ rms_norm(x, self.w["backbone.norm_f.weight"], self.g.norm_eps)

    def bundle_states(self, state: dict) -> dict:
        conv, ssm = STATE_NAMES
        return {conv: state["conv"].unsqueeze(1).float().numpy().copy(),
                ssm: state["ssm"].unsqueeze(1).float().numpy().copy()}


# --- the export graph --------------------------------------------------------------------------


def rms(x: "torch.Tensor", eps: float) -> "torch.Tensor":
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def stable_log1p_exp(x: "torch.Tensor") -> "torch.Tensor":
    """log(1 + e^x) (the step size's activation), written so that no intermediate overflows
    (max(x, 0) + log1p(e^-|x|)): the library op's decomposition forms e^x first, which overflows
    fp16 on a device delegate."""
    import torch

    return torch.clamp(x, min=0) + torch.log1p(torch.exp(-torch.abs(x)))


def norm_params(width: int) -> "nn.Module":
    """An RMS norm's parameters (``weight``, ones): the norm itself is :func:`rms`, inline."""
    import torch
    from torch import nn

    m = nn.Module()
    m.weight = nn.Parameter(torch.ones(width))
    return m


def conv_params(width: int, kernel: int) -> "nn.Module":
    """The depthwise causal conv's parameters (conv1d.weight [width,1,K], conv1d.bias); not an
    nn.Conv1d, so no quantiser takes it for a layer to quantise."""
    import torch
    from torch import nn

    m = nn.Module()
    m.weight = nn.Parameter(torch.zeros(width, 1, kernel))
    m.bias = nn.Parameter(torch.zeros(width))
    return m


def backbone(g: Any, block: Callable[[Any], "nn.Module"]) -> "nn.Module":
    """``embeddings``, ``layers`` (one ``block(g)`` each) and ``norm_f``: the normal form's
    ``backbone.*`` names."""
    from torch import nn

    m = nn.Module()
    m.embeddings = nn.Embedding(g.vocab, g.hidden)
    m.layers = nn.ModuleList(block(g) for _ in range(g.layers))
    m.norm_f = norm_params(g.hidden)
    return m


def run(m: "nn.Module", input_ids: "torch.Tensor", T: int) -> "torch.Tensor":
    """Logits [1,1,V] of the last of T tokens; each state written ONCE, at the end. Each block's
    ``step(x, conv_prev, S)`` takes the residual stream [T,C] (wide dtype) and its layer's state
    slices, and returns the stream and the new slices."""
    import torch

    from recurrent_coreai.coreai.layers import linear, wide

    g = m.g
    dtype = m.ssmState.dtype
    wd = wide(dtype)
    x = m.backbone.embeddings(input_ids.reshape(T).to(torch.int64)).to(wd)       # [T,C]
    convs, ssms = [], []
    for i, block in enumerate(m.backbone.layers):
        x, conv, S = block.step(x, m.convState[i, 0], m.ssmState[i, 0])
        convs.append(conv.unsqueeze(0))
        ssms.append(S.unsqueeze(0))
    m.convState.copy_(torch.stack(convs))
    m.ssmState.copy_(torch.stack(ssms))
    last = x if T == 1 else x[-1:]
    h = (rms(last, g.norm_eps) * m.backbone.norm_f.weight.to(wd)).to(dtype)
    return linear(m.lm_head, h).reshape(1, 1, g.vocab)
