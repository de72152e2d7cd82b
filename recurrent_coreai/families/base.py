"""The family seam: everything architecture-specific goes through :class:`Family`.

A family is a folder ``families/<name>/`` whose ``__init__.py`` defines ``FAMILY``, an instance of
a :class:`Family` subclass. The registry (``families/__init__.py``) imports a family by name
only when a model of it is built; stages, the Core AI layer, the hub and the tools never import
a family module directly (import-linter checks it: docs/architecture.md).

What a family answers (in the spirit of mlx-lm's per-model files, llama.cpp's registered
converter classes and optimum's per-model export configs):

* **geometry** -- from config.yaml's synthetic ``shape``, from a checkpoint's ``config.json``, or
  (layouts without one) from the tensor shapes; checked, with the parameter count;
* **checkpoint layouts** -- which ones it accepts, how it recognises them, and the normalisation of
  each to ONE normal form (names and shapes checked; a missing, extra or mis-shaped tensor names
  the tensor and the expected shape);
* **synthetic weights** -- a seeded, deterministic random init in the normal form;
* **the reference** -- a plain token-by-token implementation in fp32/fp64 (the gate's oracle),
  whose states convert to the bundle's layout;
* **the export modules** -- ``main`` (decode, one token) and ``prefill`` (a chunk), over the same
  state buffers, each state written exactly once per call;
* **state specs** -- names, shapes and meanings (export.json records names and shapes; the card
  and catalog show the meanings);
* **the tokenizer kind** (a key of ``tokenizers.KINDS``: ``world``, ``hf-bpe``, ``sp-bpe``; the default of its models,
  which may name another, ``bytes`` included: ``families.tokenizer_of``), **quantisation roles**, **card rows** and the
  sources coreai doctor lints.
"""

from __future__ import annotations

import abc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping

from recurrent_coreai.coreai import TRACED_SOURCES

# Roles a recipe may name instead of a raw regex (config: recipes.<r>.quantize.roles). A family maps
# each to a pattern over its decode module's linear names; a role a family does not have matches
# nothing there.
ROLES = {
    "lm_head": "the output projection to the vocabulary",
    "mlp": "the channel-mix / feed-forward linears (no recurrence reads them)",
    "mixer_output": "the linear after the recurrence (RWKV o_proj, Mamba out_proj)",
    "state_inputs": "every linear whose output feeds the recurrence or its gates (r/k/v, LoRAs, in_proj)",
}


@dataclass(frozen=True)
class StateSpec:
    """One state of the bundle, as the export modules hold it (batch dimension included)."""

    name: str
    shape: tuple[int, ...]
    meaning: str  # one line: what each axis holds (card, catalog)

    def as_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "meaning": self.meaning}


class Geometry(abc.ABC):
    """A family's geometry: a frozen dataclass with ``as_dict()`` (what records store) and
    ``check(where)`` (raises PipelineError, returns self)."""

    def as_dict(self) -> dict:
        return asdict(self)  # type: ignore[call-overload]

    @abc.abstractmethod
    def check(self, where: str | Path = "config") -> "Geometry":
        ...


class Reference(abc.ABC):
    """The oracle: one token at a time, fp32 or fp64, no tricks."""

    def __init__(self, weights: Mapping[str, Any], geom: Geometry, dtype: Any = None):
        """``self.w``: the weights (:meth:`normal_weights` of them) in ``dtype`` (float32 by
        default, or float64); ``self.g``: the geometry."""
        import torch

        dtype = dtype or torch.float32
        if dtype not in (torch.float32, torch.float64):
            raise ValueError("the reference runs in float32 or float64")
        self.g, self.dtype = geom, dtype
        self.w = {k: v.detach().to(dtype) for k, v in self.normal_weights(weights, geom).items()}

    def normal_weights(self, weights: Mapping[str, Any], geom: Geometry) -> Mapping[str, Any]:
        """The weights the oracle reads, by normal-form name (a family may check them here)."""
        return weights

    @abc.abstractmethod
    def zero_state(self) -> Any:
        ...

    def step(self, token: int, state: Any) -> "Any":
        """Logits [V] (a torch tensor) for one token; ``state`` is updated in place."""
        return self.logits(self.advance(token, state))

    @abc.abstractmethod
    def advance(self, token: int, state: Any) -> "Any":
        """One token through every layer: the residual stream before the final norm; ``state`` is
        updated in place. Where no logits are wanted (most of the gate's text stream) this is the
        whole step: a large vocabulary's head is most of a step's cost (rwkv7-tiny: 5.8 of 6.5 ms)."""

    @abc.abstractmethod
    def logits(self, x: Any) -> "Any":
        """The final norm and the head over :meth:`advance`'s output: logits [V]."""

    @abc.abstractmethod
    def bundle_states(self, state: Any) -> dict[str, Any]:
        """The state as the bundle stores it: {state name: float32 numpy array of the spec's shape}."""

    def run(self, tokens, state=None):
        """Logits [T, V] for a token sequence, fed one at a time, and the final state."""
        import torch

        state = state if state is not None else self.zero_state()
        return torch.stack([self.step(int(t), state) for t in tokens]), state

    def greedy(self, prompt, n_new: int, state=None, stop: int | None = None) -> list[int]:
        """Greedy continuation of ``prompt`` (at most ``n_new`` tokens; stops after ``stop``)."""
        import torch

        state = state if state is not None else self.zero_state()
        logits = None
        for t in prompt:
            logits = self.step(int(t), state)
        out: list[int] = []
        for _ in range(n_new):
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            if stop is not None and nxt == stop:
                break
            logits = self.step(nxt, state)
        return out


def shape_to(geometry_type: type, family: "Family", shape: Any, where: str | Path,
             extra_check: Callable[[Any, Any], None] | None = None, optional: Mapping[str, Any] | None = None):
    """config.yaml's ``source.shape`` -> the family's geometry: exactly ``family.shape_keys`` (plus
    ``optional`` ones), each a positive integer, then ``Geometry.check`` and ``extra_check``.
    Each problem is one line naming the key."""
    from recurrent_coreai.util.errors import PipelineError

    fix = f"give source.shape exactly the keys {', '.join(family.shape_keys)} (family {family.name})"
    if not isinstance(shape, Mapping):
        raise PipelineError(where, f"source.shape is a {type(shape).__name__}, not a mapping", fix)
    optional = dict(optional or {})
    unknown = sorted(set(shape) - set(family.shape_keys) - set(optional))
    if unknown:
        raise PipelineError(where, f"source.shape has key {unknown[0]!r}, which family {family.name} does not know",
                            fix)
    missing = [k for k in family.shape_keys if k not in shape]
    if missing:
        raise PipelineError(where, f"source.shape lacks {missing[0]!r}", fix)
    values = {**optional, **dict(shape)}
    for key in family.shape_keys:
        value = values[key]
        if type(value) is not int or value <= 0:
            raise PipelineError(where, f"source.shape.{key} must be a positive integer, got {value!r}", fix)
    geom = geometry_type(**values).check(where)
    if extra_check is not None:
        extra_check(geom, where)
    return geom


EachLinear = Callable[[str, Any], Any]  # (module name, nn.Linear) -> the module to put in its place


class Family(abc.ABC):
    """One architecture. Subclass it in ``families/<name>/__init__.py`` as ``FAMILY``."""

    name: ClassVar[str]                      # registry key, config's models.<m>.family
    display_name: ClassVar[str]              # e.g. "RWKV-7 (x070)"
    catalog_family: ClassVar[str]            # coreai-catalog's `family` (e.g. "RWKV", "Mamba")
    tokenizer: ClassVar[str]                 # its models' default tokenizer kind: a key of tokenizers.KINDS
    layouts: ClassVar[tuple[str, ...]]       # accepted checkpoint layouts; [0] is the normal form
    synthetic_layouts: ClassVar[tuple[str, ...]]  # layouts a synthetic source may be written in
    hf_model_types: ClassVar[tuple[str, ...]]     # config.json model_type values it accepts
    roles: ClassVar[dict[str, str]]          # quantisation role (ROLES) -> regex over linear names
    tags: ClassVar[tuple[str, ...]]          # model card tags beside "coreai", "no-kv-cache"
    max_chunk: ClassVar[int]                 # the largest prefill chunk its chunked form allows
    shape_keys: ClassVar[tuple[str, ...]]    # config.yaml source.shape keys (synthetic)
    # The smallest source.shape that still exercises every part (each state, layer 0's extras, the
    # groups): every per-family test builds its model from it (tests/families/test_contract.py checks
    # that each registered family has one and that it builds).
    tiny_shape: ClassVar[dict[str, Any]]
    # Many methods below are, by default, the function of the same name in one of the family's own
    # modules (``families/<name>/geometry.py``, ``layouts.py``, ``synthetic.py``, ``reference.py``
    # and :attr:`export_module`), imported when first used; a family overrides a method only where
    # its code is named or called otherwise.
    export_module: ClassVar[str] = "export_modules"  # the module of build_decode and build_prefill

    def _own(self, module: str, name: str) -> Any:
        """``name`` from the family's module ``module`` (``families/<family>/<module>.py``)."""
        import importlib

        package = type(self).__module__
        found = getattr(importlib.import_module(f"{package}.{module}"), name, None)
        if found is None:
            raise NotImplementedError(f"family {self.name}: {package}.{module} has no {name} "
                                      f"(write it there, or override the method in {type(self).__name__})")
        return found

    # --- geometry -------------------------------------------------------------------------
    @abc.abstractmethod
    def geometry_from_shape(self, shape: Mapping, where: str | Path) -> Geometry:
        """config.yaml's ``source.shape`` (unknown or missing keys are one-line errors)."""

    def geometry_from_config(self, cfg: Any, where: str | Path) -> Geometry:
        """A checkpoint's config.json (parsed); ``where`` names the file in errors."""
        return self._own("geometry", "geometry_from_config")(cfg, where)

    def geometry_from_tensors(self, shapes: Mapping[str, tuple[int, ...]], layout: str,
                              where: str | Path) -> Geometry | None:
        """For a layout without a config.json (e.g. a BlinkDL .pth): the geometry read off the
        tensor shapes; None when the layout needs a config.json."""
        return None

    @abc.abstractmethod
    def geometry_from_dict(self, d: Mapping) -> Geometry:
        """The inverse of ``Geometry.as_dict`` (what manifest.json / export.json record)."""

    def config_json(self, geom: Geometry) -> dict:
        """config.json for the normal form (written beside the normalised weights)."""
        return self._own("geometry", "config_json")(geom)

    def tied_linears(self, geom: Geometry) -> dict[str, str]:
        """Decode-module linears whose weight is tied to another tensor ({linear: tensor}): a role
        keeps them unquantised (coreai/quantize.py). None by default."""
        del geom
        return {}

    def parameter_count(self, geom: Geometry) -> int:
        import math

        return sum(math.prod(s) for s in self.normal_shapes(geom).values())

    # --- checkpoints ----------------------------------------------------------------------
    def detect_layout(self, names: Iterable[str]) -> str | None:
        """Which of :attr:`layouts` these tensor names are in; None when they are not this
        family's at all (the registry then asks the other families, for the message)."""
        return self._own("layouts", "detect_layout")(names)

    def normal_shapes(self, geom: Geometry) -> dict[str, tuple[int, ...]]:
        """Every tensor of the normal form, name -> shape, in the order files store them."""
        return self._own("geometry", "normal_shapes")(geom)

    def normalize(self, sd: Mapping[str, Any], geom: Geometry, where: str | Path) -> dict[str, Any]:
        """Any accepted layout -> the normal form (in :meth:`normal_shapes` order); every name and
        shape checked. Works on meta tensors too (names and shapes only)."""
        return self._own("layouts", "normalize")(sd, geom, where)

    def streams(self, layout: str) -> bool:
        """Whether ``layout`` normalises tensor by tensor (renames, splits: :meth:`normal_parts`),
        so a checkpoint in it is normalised while streamed; otherwise it is read whole."""
        return layout == self.layouts[0]

    def normal_parts(self, layout: str, name: str, tensor: Any) -> list[tuple[str, Any]]:
        """The normal-form tensors ONE stored tensor of a streaming layout (:meth:`streams`) becomes
        (none: a tensor the normal form drops). A problem with its values is a PipelineError whose
        ``where`` is the tensor's name: the reader puts the file in its place."""
        return self._own("layouts", "normal_parts")(layout, name, tensor)

    def normal_stream(self, layout: str, geom: Geometry,
                      names: Iterable[str]) -> Callable[[str, Any], list[tuple[str, Any]]] | None:
        """How a checkpoint in ``layout`` holding the tensors ``names`` is normalised while streamed: a
        function of (stored name, tensor) giving that tensor's normal-form parts, called once per
        stored tensor in file order (a fresh one per checkpoint); None when it is read whole. By
        default :meth:`normal_parts` where :meth:`streams` says so. A family whose streaming needs
        the geometry or the other names (a tied head left out, or stored beside its embedding and
        checked equal to it) overrides this one."""
        if not self.streams(layout):
            return None
        return lambda name, tensor: self.normal_parts(layout, name, tensor)

    def synthetic_tensors(self, geom: Geometry, seed: int) -> Iterator[tuple[str, Any]]:
        """Seeded random weights in the normal form, one tensor at a time, :meth:`normal_shapes`
        order; the same seed gives the same bytes."""
        return self._own("synthetic", "synthetic_tensors")(geom, seed)

    def write_synthetic(self, geom: Geometry, seed: int, out_dir: Path, layout: str) -> Path:
        """The synthetic weights written in ``layout`` (:meth:`write_layout` of them all; a family may
        stream them one tensor at a time instead, with the same bytes)."""
        return self.write_layout(dict(self.synthetic_tensors(geom, seed)), out_dir, layout, geom)

    @abc.abstractmethod
    def write_layout(self, sd: Mapping[str, Any], out_dir: Path, layout: str, geom: Geometry | None = None) -> Path:
        """Normal-form weights written in ``layout`` (the weights file, plus its config.json when
        the layout has one, which may need ``geom``: what tensor shapes do not show); returns the
        weights file."""

    # --- math -----------------------------------------------------------------------------
    def reference(self, weights: Mapping[str, Any], geom: Geometry, dtype: Any = None) -> Reference:
        """The oracle over normal-form weights (fp32 by default, or fp64): the ``Reference`` class
        of the family's ``reference`` module."""
        return self._own("reference", "Reference")(weights, geom, dtype)

    def state_specs(self, geom: Geometry) -> list[StateSpec]:
        """The bundle's states, in the order the export modules register them: by default the
        family's ``geometry.state_specs``, which its decode module builds its buffers from (the
        shapes are stated once)."""
        return self._own("geometry", "state_specs")(geom)

    def tuned_states(self, tensors: Mapping[str, Any], geom: Geometry, where: str | Path) -> dict[str, Any]:
        """A state-tuning file's tensors (BlinkDL's trainer, RWKV-PEFT: a trained initial state per
        layer) as the bundle's initial states, :meth:`state_specs` names and shapes, float32 numpy.
        Only a family whose trainers write such files has them (RWKV-6, RWKV-7: :func:`rwkv_time_states`)."""
        del tensors, geom
        from recurrent_coreai.util.errors import PipelineError

        raise PipelineError(where, f"is a state-tuning file, which family {self.name} has none of (BlinkDL's trainer "
                            "writes them for RWKV-6 and RWKV-7)", "load a state file generate --save-state wrote")

    def build_decode(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]], geom: Geometry, dtype: Any,
                     each_linear: EachLinear | None = None) -> Any:
        """The decode module (``input_ids`` [1,1] int32, ``position_ids`` [1,1] int32 -> ``logits``
        [1,1,V]) with state buffers named as :meth:`state_specs`, weights loaded strictly; built on
        the meta device, each weight assigned as it comes. ``each_linear(name, linear)`` is called
        once a Linear's weights are in and returns the module to put in its place (quantisation)."""
        return self._own(self.export_module, "build_decode")(weights, geom, dtype, each_linear)

    def decode_skeleton(self, geom: Geometry, dtype: Any) -> Any:
        """The decode module on the meta device, without weights: its linear layers' names and
        shapes are what a quantisation plan is made from (before any weight is read)."""
        import torch

        meta = ((n, torch.empty(s, device="meta")) for n, s in self.normal_shapes(geom).items())
        return self.build_decode(meta, geom, dtype)

    def build_prefill(self, decode: Any, chunk: int) -> Any:
        """The prefill module over ``decode``'s own submodules and state buffers (same parameter
        names: weights stored once): ``input_ids`` [1,chunk] -> logits of the last position [1,1,V]."""
        return self._own(self.export_module, "build_prefill")(decode, chunk)

    # --- tokenizer and card ----------------------------------------------------------------
    @abc.abstractmethod
    def card_rows(self, geom: Geometry) -> list[tuple[str, str]]:
        """The card's architecture table: (label, value) rows."""

    # (the smallest vocab a tokenizer's ids fit in follows the model's kind: tokenizers.kind(k).MIN_VOCAB)
    vocab_tensors: ClassVar[tuple[str, ...]] = ()  # normal-form tensors indexed by token id (embedding, head)

    def vocab_rows(self, geom: Geometry) -> dict[str, int]:
        """{tensor: rows} of :attr:`vocab_tensors`: each needs a row for every id the tokenizer
        produces (the source stage checks it: tokenizers/fit.py); rows beyond are padding."""
        if not self.vocab_tensors:
            raise NotImplementedError(f"family {self.name}: set vocab_tensors (its embedding and head tensors)")
        shapes = self.normal_shapes(geom)
        return {name: shapes[name][0] for name in self.vocab_tensors}

    def original_name(self, layout: str, normal: str) -> str:
        """The name a checkpoint in ``layout`` stores the normal-form tensor ``normal`` under (a
        message about a checkpoint names its own tensors: ``emb.weight`` of a BlinkDL .pth, not
        the normal form's name): the family's ``layouts.original_name``."""
        return self._own("layouts", "original_name")(layout, normal)

    def stored_vocab_rows(self, geom: Geometry, layout: str) -> dict[str, int]:
        """:meth:`vocab_rows` keyed by the names a checkpoint in ``layout`` stores them under (the
        source stage's fit check names the file's own tensors)."""
        return {self.original_name(layout, name): rows for name, rows in self.vocab_rows(geom).items()}
    card_summary: ClassVar[str] = ""         # the card's paragraph on the architecture
    export_sources: ClassVar[tuple[str, ...]] = ()  # repo-relative files coreai doctor lints

    def doctor_sources(self) -> tuple[str, ...]:
        """What coreai doctor lints for this family: the shared traced layers and its export sources."""
        return (*TRACED_SOURCES, *self.export_sources)

    def describe(self) -> str:
        return f"{self.name} ({self.display_name})"


def rwkv_time_states(tensors: Mapping[str, Any], layers: int, heads: int, head_dim: int, where: str | Path):
    """The matrix state of a BlinkDL state-tuning file as a bundle's ``[layers, 1, heads, K, V]``
    (float32 numpy). The file holds ``blocks.<i>.att.time_state`` per layer, ``[heads, V, K]``:
    the orientation of the trainers' wkv kernels and of the official ``rwkv`` package's RWKV-7 state
    (``state[3i+1]``, ``v k^T`` added each token); its RWKV-6 loader transposes it to ``[H, K, V]``
    (``w['blocks.i.att.time_state'].transpose(1,2)``). Nothing else may be in the file; a missing
    layer, another shape or a non-finite value is one line naming ``where``."""
    import numpy as np

    from recurrent_coreai.util.errors import PipelineError

    fix = "give a state-tuning file trained for this model (its layers, heads and head size)"
    want = [f"blocks.{i}.att.time_state" for i in range(layers)]
    extra, missing = sorted(set(tensors) - set(want)), [n for n in want if n not in tensors]
    if missing or extra:
        raise PipelineError(where, f"is not a state-tuning file of this {layers}-layer model (missing "
                            f"{missing[:3] or 'none'}, not a time_state: {extra[:3] or 'none'})", fix)
    out = np.zeros((layers, 1, heads, head_dim, head_dim), np.float32)
    for i, name in enumerate(want):
        t = tensors[name]
        arr = np.asarray(t.float().numpy() if hasattr(t, "float") else t, dtype=np.float32)
        if arr.shape != (heads, head_dim, head_dim):
            raise PipelineError(where, f"{name} has shape {list(arr.shape)}, this model's state per layer is "
                                f"[{heads}, {head_dim}, {head_dim}] (heads, head size, head size)", fix)
        if not np.isfinite(arr).all():
            raise PipelineError(where, f"{name} holds non-finite values (NaN or infinite)", fix)
        out[i, 0] = arr.transpose(0, 2, 1)  # [H, V, K] -> the bundle's [H, K, V]
    return out
