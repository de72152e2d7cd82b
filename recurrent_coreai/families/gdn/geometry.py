"""Gated DeltaNet geometry: from config.yaml's synthetic shape or fla's ``GatedDeltaNetConfig``
config.json (``model_type: gated_deltanet``), checked.

fla's names -> ours: ``num_hidden_layers`` layers, ``hidden_size`` hidden, ``num_heads`` heads (the
q/k heads), ``head_dim`` head_dim (= head_k_dim), ``num_v_heads`` v_heads (null: = num_heads; more
than num_heads is GVA, each q/k head serving v_heads/heads value heads), ``expand_v`` (head_v_dim =
head_dim x expand_v), ``conv_size``, ``intermediate_size`` (or, when null, fla's GatedMLP rule:
``int(hidden x hidden_ratio x 2/3)`` rounded up to a multiple of 256), ``vocab_size``, ``norm_eps``,
``allow_neg_eigval`` (beta x 2), ``use_gate`` (the output gate g_proj), ``tie_word_embeddings``.

Refused in one line, naming the key: ``attn`` set (attention layers keep a KV cache, which this
factory does not build), ``use_short_conv: false``, ``hidden_act`` other than swish,
``attnres_block_size`` set (attention residuals), ``output_gate_activation`` other than swish,
``conv_bias: true``. Keys that choose kernels or training behaviour (``attn_mode``, ``fuse_*``,
``use_l2warp``, ``initializer_range``, ...) do not change the math and are ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Mapping

from recurrent_coreai.families import base
from recurrent_coreai.families.hparams import HParams
from recurrent_coreai.util.errors import PipelineError

# config.yaml source.shape: the required keys (positive integers) and the optional ones with defaults
SHAPE_KEYS = ("layers", "hidden", "heads", "head_dim", "vocab", "intermediate")
OPTIONAL = {"v_heads": 0, "expand_v": 1.0, "conv_size": 4, "norm_eps": 1e-6, "allow_neg_eigval": False,
            "use_gate": True, "tie_embeddings": False}


@dataclass(frozen=True)
class Geometry(base.Geometry):
    layers: int
    hidden: int
    heads: int            # q/k heads
    head_dim: int         # K (head_k_dim)
    vocab: int
    intermediate: int     # the SwiGLU MLP's width
    v_heads: int = 0      # value heads (0: = heads); a multiple of heads
    expand_v: float = 1.0  # head_v_dim = head_dim x expand_v
    conv_size: int = 4
    norm_eps: float = 1e-6
    allow_neg_eigval: bool = False
    use_gate: bool = True
    tie_embeddings: bool = False

    @property
    def hv(self) -> int:
        """Value heads (the recurrent state's heads)."""
        return self.v_heads or self.heads

    @property
    def head_v_dim(self) -> int:  # V
        return int(round(self.head_dim * self.expand_v))

    @property
    def key_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.hv * self.head_v_dim

    def as_dict(self) -> dict:
        return asdict(self)

    def check(self, where: str | Path = "config") -> "Geometry":
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("allow_neg_eigval", "use_gate", "tie_embeddings"):
                if not isinstance(value, bool):
                    raise PipelineError(where, f"{f.name} must be true or false, got {value!r}", "fix the model shape")
                continue
            if f.name == "v_heads" and value == 0:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise PipelineError(where, f"{f.name} must be positive, got {value!r}", "fix the model shape")
            if f.type in ("int", int) and not isinstance(value, int):
                raise PipelineError(where, f"{f.name} must be an integer, got {value!r}", "fix the model shape")
        if not math.isclose(self.head_dim * self.expand_v, self.head_v_dim, rel_tol=1e-5) or self.head_v_dim < 1:
            raise PipelineError(where, f"head_dim x expand_v = {self.head_dim} x {self.expand_v} is not a whole number",
                                "choose expand_v so that head_dim x expand_v is an integer (fla requires it too)")
        if self.hv % self.heads:
            raise PipelineError(where, f"v_heads {self.hv} is not a multiple of heads {self.heads}",
                                "num_v_heads must be a multiple of num_heads (GVA maps v head i to q/k head "
                                "i // (num_v_heads/num_heads))")
        if self.conv_size < 2:
            raise PipelineError(where, f"conv_size is {self.conv_size}; the short conv needs at least 2 taps",
                                "use conv_size >= 2 (fla's default is 4)")
        return self


def geometry_from_shape(family, shape: Mapping, where: str | Path) -> Geometry:
    return base.shape_to(Geometry, family, shape, where, optional=OPTIONAL)


# --- config.json -----------------------------------------------------------------------------
def mlp_width(hidden: int, hidden_ratio: float | None, intermediate: int | None) -> int:
    """fla's GatedMLP: ``intermediate_size`` when given, else int(hidden x hidden_ratio x 2/3) rounded up
    to a multiple of 256 (hidden_ratio 4 when null)."""
    if intermediate is not None:
        return intermediate
    width = int(hidden * (4 if hidden_ratio is None else hidden_ratio) * 2 / 3)
    return 256 * ((width + 255) // 256)


def geometry_from_config(cfg: object, where: str | Path) -> Geometry:
    """fla's GatedDeltaNetConfig (its defaults for absent keys), through the one config.json reader."""
    r = HParams(cfg, where, fix="use the config.json of fla's GatedDeltaNetForCausalLM",
                port="Gated DeltaNet", port_fix="use a pure Gated DeltaNet checkpoint of fla's GatedDeltaNetForCausalLM")
    if r.value("model_type") != "gated_deltanet":
        raise PipelineError(where, f"model_type is {r.value('model_type')!r}, not 'gated_deltanet'",
                            "point the source at a Gated DeltaNet checkpoint (fla GatedDeltaNetForCausalLM)")
    if r.has("attn"):
        raise PipelineError(where, f"attn is {json.dumps(r.value('attn'))[:80]}: a hybrid with attention layers keeps "
                            "a KV cache, which this factory does not build", "use a pure Gated DeltaNet checkpoint (attn: null)")
    r.require("use_short_conv", lambda v: v is True, True, "use_short_conv true")
    r.require("hidden_act", lambda v: v in ("swish", "silu"), "swish", 'hidden_act "swish" (SwiGLU)')
    r.require("attnres_block_size", lambda v: v is None, None, "attnres_block_size null (no attention residuals)")
    r.require("output_gate_activation", lambda v: v in ("swish", "silu"), "swish", 'output_gate_activation "swish"')
    r.require("conv_bias", lambda v: v is False, False, "conv_bias false (fla's convs have no bias)")
    hidden = r.whole("hidden_size", default=2048)
    heads = r.whole("num_heads", default=6)
    ratio = r.number("hidden_ratio", default=None)
    v_heads = r.whole("num_v_heads", default=heads)
    return Geometry(
        layers=r.whole("num_hidden_layers", default=21), hidden=hidden, heads=heads,
        head_dim=r.whole("head_dim", default=256), vocab=r.whole("vocab_size", default=32000),
        intermediate=mlp_width(hidden, ratio, r.whole("intermediate_size", default=None)),
        v_heads=0 if v_heads == heads else v_heads, expand_v=r.number("expand_v", default=2.0),
        conv_size=r.whole("conv_size", default=4), norm_eps=r.number("norm_eps", default=1e-6),
        allow_neg_eigval=r.flag("allow_neg_eigval", default=False), use_gate=r.flag("use_gate", default=True),
        tie_embeddings=r.flag("tie_word_embeddings", default=False),
    ).check(where)


def config_json(g: Geometry) -> dict:
    """config.json of the normal form: fla's GatedDeltaNetConfig (from_pretrained loads it)."""
    return {
        "architectures": ["GatedDeltaNetForCausalLM"],
        "model_type": "gated_deltanet",
        "attn": None,
        "attn_mode": "chunk",
        "hidden_size": g.hidden,
        "num_hidden_layers": g.layers,
        "num_heads": g.heads,
        "num_v_heads": g.v_heads or None,
        "head_dim": g.head_dim,
        "expand_v": g.expand_v,
        "conv_size": g.conv_size,
        "use_short_conv": True,
        "use_gate": g.use_gate,
        "allow_neg_eigval": g.allow_neg_eigval,
        "hidden_act": "swish",
        "hidden_ratio": 4,
        "intermediate_size": g.intermediate,
        "norm_eps": g.norm_eps,
        "vocab_size": g.vocab,
        "tie_word_embeddings": g.tie_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


# The longest prefill chunk (export_modules): the chunk form's exponents are all <= 0 and (I + A)^-1 is
# a product of log2(T) matrices, verified exact up to this length (tests/families/test_gdn_export.py).
MAX_CHUNK = 128

STATE_NAMES = ("convQState", "convKState", "convVState", "recurrentState")


def state_specs(g: Geometry) -> list[base.StateSpec]:
    """The bundle's states, in registration order: the decode module (export_modules) builds its
    buffers from these. The delta-rule state is [Hv, K, V] (key rows, value columns: fla's
    naive/recurrent layout; fla >= 0.5.2's cache holds it [V, K], ``state_v_first``)."""
    q, k, v, s = STATE_NAMES
    window = "the last conv_size inputs of the {} short conv ({} channels), newest last"
    return [
        base.StateSpec(q, (g.layers, 1, g.key_dim, g.conv_size), "per layer: " + window.format("q", "key_dim")),
        base.StateSpec(k, (g.layers, 1, g.key_dim, g.conv_size), "per layer: " + window.format("k", "key_dim")),
        base.StateSpec(v, (g.layers, 1, g.value_dim, g.conv_size), "per layer: " + window.format("v", "value_dim")),
        base.StateSpec(s, (g.layers, 1, g.hv, g.head_dim, g.head_v_dim),
                       "per layer and value head: the delta-rule state S, head_dim (key) x head_v_dim (value)"),
    ]


def normal_shapes(g: Geometry) -> dict[str, tuple[int, ...]]:
    """The normal form (fla's GatedDeltaNetForCausalLM names, lm_head always present), in file order."""
    C, Dk, Dv, K = g.hidden, g.key_dim, g.value_dim, g.conv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embeddings.weight": (g.vocab, C)}
    for i in range(g.layers):
        p = f"model.layers.{i}."
        shapes[p + "attn_norm.weight"] = (C,)
        shapes[p + "attn.q_proj.weight"] = (Dk, C)
        shapes[p + "attn.k_proj.weight"] = (Dk, C)
        shapes[p + "attn.v_proj.weight"] = (Dv, C)
        shapes[p + "attn.a_proj.weight"] = (g.hv, C)
        shapes[p + "attn.b_proj.weight"] = (g.hv, C)
        shapes[p + "attn.A_log"] = (g.hv,)
        shapes[p + "attn.dt_bias"] = (g.hv,)
        shapes[p + "attn.q_conv1d.weight"] = (Dk, 1, K)
        shapes[p + "attn.k_conv1d.weight"] = (Dk, 1, K)
        shapes[p + "attn.v_conv1d.weight"] = (Dv, 1, K)
        if g.use_gate:
            shapes[p + "attn.g_proj.weight"] = (Dv, C)
        shapes[p + "attn.o_norm.weight"] = (g.head_v_dim,)
        shapes[p + "attn.o_proj.weight"] = (C, Dv)
        shapes[p + "mlp_norm.weight"] = (C,)
        shapes[p + "mlp.gate_proj.weight"] = (g.intermediate, C)
        shapes[p + "mlp.up_proj.weight"] = (g.intermediate, C)
        shapes[p + "mlp.down_proj.weight"] = (C, g.intermediate)
    shapes["model.norm.weight"] = (C,)
    shapes["lm_head.weight"] = (g.vocab, C)
    return shapes
