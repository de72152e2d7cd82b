"""Mamba-2 geometry: from config.yaml's synthetic shape, from either config.json style, checked.

Two config.json styles exist in the wild:

* transformers ``Mamba2Config`` (``model_type: mamba2``): ``hidden_size``, ``num_hidden_layers``,
  ``state_size``, ``head_dim``, ``num_heads``, ``n_groups``, ``expand``, ``conv_kernel``,
  ``vocab_size``, ``layer_norm_epsilon``, ``tie_word_embeddings``, ``use_bias``, ``use_conv_bias``,
  ``hidden_act``, ``time_step_limit`` ...;
* the original ``state-spaces/mamba2-*`` (mamba_ssm ``MambaConfig``): ``d_model``, ``n_layer``,
  ``vocab_size`` (padded up to ``pad_vocab_size_multiple`` by ``MambaLMHeadModel``),
  ``d_intermediate`` (0: no MLP), ``ssm_cfg`` (``layer: Mamba2`` plus the ``Mamba2`` module's
  keyword arguments, defaults d_state 128, d_conv 4, expand 2, headdim 64, ngroups 1),
  ``attn_layer_idx``, ``rms_norm``, ``tie_embeddings`` (default true). Its norms' eps is 1e-5
  (the gated norm's is hard-coded, the block norms' is MixerModel's default).

Anything this port does not implement (biases on the projections, an MLP, attention layers, a
dt clamp, norm before gate, per-channel D ...) is a one-line error naming the key.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

from recurrent_coreai.families import base, ssm
from recurrent_coreai.families.hparams import REQUIRED, HParams, json_float
from recurrent_coreai.util.errors import PipelineError

# config.yaml source.shape keys -> (type, default or REQUIRED)
SHAPE_KEYS: dict[str, tuple[type, object]] = {
    "layers": (int, REQUIRED), "hidden": (int, REQUIRED), "d_state": (int, REQUIRED),
    "headdim": (int, REQUIRED), "vocab": (int, REQUIRED), "n_groups": (int, 1), "expand": (int, 2),
    "conv_kernel": (int, 4), "norm_eps": (float, 1e-5), "tie_embeddings": (bool, False),
}


@dataclass(frozen=True)
class Geometry(base.Geometry):
    layers: int
    hidden: int          # d_model
    d_state: int         # N
    headdim: int         # P
    vocab: int
    n_groups: int = 1    # G
    expand: int = 2
    conv_kernel: int = 4  # K
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # the checkpoint ties lm_head to the embedding (the normal form holds both)

    @property
    def intermediate(self) -> int:  # I
        return self.expand * self.hidden

    @property
    def heads(self) -> int:  # H
        return self.intermediate // self.headdim

    @property
    def conv_dim(self) -> int:  # I + 2GN
        return self.intermediate + 2 * self.n_groups * self.d_state

    @property
    def in_proj_width(self) -> int:  # z, xBC, dt
        return 2 * self.intermediate + 2 * self.n_groups * self.d_state + self.heads

    def as_dict(self) -> dict:
        return asdict(self)

    def check(self, where: str | Path = "config") -> "Geometry":
        ssm.check_fields(self, where)
        if self.intermediate % self.headdim:
            raise PipelineError(where, f"expand*hidden = {self.intermediate} is not a multiple of headdim {self.headdim}",
                                "choose hidden, expand and headdim with expand*hidden divisible by headdim")
        if self.heads % self.n_groups:
            raise PipelineError(where, f"heads = {self.heads} (expand*hidden/headdim) is not a multiple of n_groups "
                                f"{self.n_groups}", "choose n_groups dividing the number of heads")
        return self


def geometry_from_shape(shape: Mapping, where: str | Path) -> Geometry:
    values = ssm.shape_values(shape, SHAPE_KEYS, "Mamba-2", where)
    return Geometry(**values).check(where)


# --- config.json -----------------------------------------------------------------------------
PORT_FIX = "use a plain Mamba-2 checkpoint (or extend families/mamba2)"   # a setting this port does not implement


def _no_dt_clamp(v: object) -> bool:
    pair = [json_float(x) for x in v] if isinstance(v, (list, tuple)) else []
    return len(pair) == 2 and None not in pair and pair[0] <= 0 and pair[1] == math.inf


def _check_heads(g: Geometry, heads: int, key: str, where: str | Path) -> None:
    if heads != g.heads:
        raise PipelineError(where, f"{key} is {heads} but expand*hidden/head_dim = {g.intermediate}/{g.headdim} = "
                            f"{g.heads}", f"fix {key} (or head_dim) in config.json")


def geometry_from_hf_config(cfg: Mapping, where: str | Path) -> Geometry:
    r = HParams(cfg, where, "use the config.json of a transformers Mamba2ForCausalLM checkpoint", "Mamba-2", PORT_FIX)
    ssm.require_plain_hf_mixer(r)
    r.require("time_step_limit", _no_dt_clamp, [0.0, math.inf], "time_step_limit [0, Infinity] (no dt clamp)")
    g = Geometry(
        layers=r.whole("num_hidden_layers"), hidden=r.whole("hidden_size"), d_state=r.whole("state_size"),
        headdim=r.whole("head_dim"), vocab=r.whole("vocab_size"), n_groups=r.whole("n_groups"),
        expand=r.whole("expand", default=2), conv_kernel=r.whole("conv_kernel", default=4),
        norm_eps=r.number("layer_norm_epsilon", default=1e-5),
        tie_embeddings=r.flag("tie_word_embeddings", default=False),
    ).check(where)
    if "num_heads" in cfg:
        _check_heads(g, r.whole("num_heads"), "num_heads", where)
    return g


# Mamba2(...) keyword arguments; the ones that only shape the init or the CUDA path are ignored
SSM_CFG_KEYS = {"layer", "d_state", "d_conv", "expand", "headdim", "ngroups", "d_ssm", "conv_init", "A_init_range",
                "D_has_hdim", "rmsnorm", "norm_before_gate", "dt_min", "dt_max", "dt_init_floor", "dt_limit", "bias",
                "conv_bias", "chunk_size", "use_mem_eff_path", "process_group", "sequence_parallel"}


def geometry_from_mamba_ssm_config(cfg: Mapping, where: str | Path) -> Geometry:
    r = HParams(cfg, where, "use the config.json of a state-spaces/mamba2-* checkpoint", "Mamba-2", PORT_FIX)
    ssm.require_plain_mamba_ssm(r)
    r.require("norm_epsilon", lambda v: v == 1e-5, 1e-5, "norm_epsilon 1e-5 (the gated norm's eps is fixed at 1e-5)")
    s = r.section("ssm_cfg")
    s.only(SSM_CFG_KEYS)
    s.require("layer", lambda v: v == "Mamba2", "Mamba1", 'layer "Mamba2" (this is a Mamba-1 config)')
    s.require("d_ssm", lambda v: v is None, None, "d_ssm null (SSM over the whole inner width)")
    s.require("D_has_hdim", lambda v: v is False, False, "D_has_hdim false (one D per head)")
    s.require("rmsnorm", lambda v: v is True, True, "rmsnorm true")
    s.require("norm_before_gate", lambda v: v is False, False, "norm_before_gate false")
    s.require("dt_limit", _no_dt_clamp, [0.0, math.inf], "dt_limit [0, Infinity] (no dt clamp)")
    s.require("bias", lambda v: v is False, False, "bias false")
    s.require("conv_bias", lambda v: v is True, True, "conv_bias true")
    vocab = ssm.mamba_ssm_vocab(r)
    return Geometry(
        layers=r.whole("n_layer"), hidden=r.whole("d_model"), d_state=s.whole("d_state", default=128),
        headdim=s.whole("headdim", default=64), vocab=vocab, n_groups=s.whole("ngroups", default=1),
        expand=s.whole("expand", default=2), conv_kernel=s.whole("d_conv", default=4), norm_eps=1e-5,
        tie_embeddings=r.flag("tie_embeddings", default=True),
    ).check(where)


def geometry_from_config(cfg: object, where: str | Path) -> Geometry:
    HParams(cfg, where, "use the config.json of a Mamba-2 checkpoint")  # a JSON object, else one line
    if "d_model" in cfg and "model_type" not in cfg:
        return geometry_from_mamba_ssm_config(cfg, where)
    if cfg.get("model_type") != "mamba2":
        raise PipelineError(where, f"model_type is {cfg.get('model_type')!r}, not 'mamba2' (and no mamba_ssm d_model)",
                            "point the source at a Mamba-2 checkpoint")
    return geometry_from_hf_config(cfg, where)


def hf_config(g: Geometry) -> dict:
    """config.json of the normal form (transformers Mamba2ForCausalLM; from_pretrained loads it)."""
    return {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "hidden_size": g.hidden,
        "num_hidden_layers": g.layers,
        "state_size": g.d_state,
        "head_dim": g.headdim,
        "num_heads": g.heads,
        "n_groups": g.n_groups,
        "expand": g.expand,
        "conv_kernel": g.conv_kernel,
        "vocab_size": g.vocab,
        "layer_norm_epsilon": g.norm_eps,
        "tie_word_embeddings": g.tie_embeddings,
        "use_bias": False,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "residual_in_fp32": True,
        "chunk_size": 256,
        "pad_token_id": 0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "float32",
    }


def mamba_ssm_config(g: Geometry) -> dict:
    """config.json as state-spaces/mamba2-* write it (MambaConfig's fields)."""
    if g.norm_eps != 1e-5:
        raise ValueError(f"the mamba_ssm layout fixes the norm eps at 1e-5, the geometry has {g.norm_eps}")
    return {
        "d_model": g.hidden, "d_intermediate": 0, "n_layer": g.layers, "vocab_size": g.vocab,
        "ssm_cfg": {"layer": "Mamba2", "d_state": g.d_state, "d_conv": g.conv_kernel, "expand": g.expand,
                    "headdim": g.headdim, "ngroups": g.n_groups},
        "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
        "pad_vocab_size_multiple": 1, "tie_embeddings": g.tie_embeddings,
    }


STATE_NAMES = ssm.STATE_NAMES  # the buffers every function reads and writes once


def state_specs(g: Geometry) -> list[base.StateSpec]:
    """The bundle's states, in registration order: the decode module (export_modules) builds its
    buffers from these."""
    return ssm.state_specs(g, g.conv_dim, "per layer: the last conv_kernel inputs of the depthwise conv "
                           "(x|B|C channels), newest last", (g.heads, g.headdim, g.d_state),
                           "per layer and head: the SSM state, headdim x d_state")


def normal_shapes(g: Geometry) -> dict[str, tuple[int, ...]]:
    """The normal form (transformers names, lm_head always present), in file order."""
    H = g.heads
    return ssm.normal_shapes(g, g.in_proj_width, g.conv_dim,
                             {"dt_bias": (H,), "A_log": (H,), "D": (H,), "norm.weight": (g.intermediate,)})
