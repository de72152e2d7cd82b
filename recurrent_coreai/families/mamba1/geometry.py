"""Mamba-1 geometry: from config.yaml's synthetic shape, from either config.json style, checked.

Two config.json styles exist in the wild:

* transformers ``MambaConfig`` / ``FalconMambaConfig`` (``model_type: mamba | falcon_mamba``):
  ``hidden_size``, ``num_hidden_layers``, ``state_size``, ``expand`` (and ``intermediate_size``,
  which tiiuae/falcon-mamba-7b states beside an ``expand`` that disagrees with it: 8192 against
  16 x 4096 -- the weights are 8192 wide, so a stated ``intermediate_size`` wins), ``conv_kernel``,
  ``time_step_rank`` (``"auto"`` = ceil(hidden_size / 16)), ``vocab_size``,
  ``layer_norm_epsilon``, ``tie_word_embeddings``, ``use_bias``, ``use_conv_bias``, ``hidden_act``
  and, Falcon Mamba only, ``mixer_rms_eps`` (the weight-free RMS norms of dt, B and C; default 1e-6);
* the original ``state-spaces/mamba-*`` (mamba_ssm ``MambaConfig``): ``d_model``, ``n_layer``,
  ``vocab_size`` (padded up to ``pad_vocab_size_multiple`` by ``MambaLMHeadModel``), ``ssm_cfg``
  (the ``Mamba`` module's keyword arguments: d_state 16, d_conv 4, expand 2, dt_rank "auto" by
  default), ``rms_norm``, ``residual_in_fp32``, ``fused_add_norm``; the head is tied, the norms' eps
  1e-5 (MixerModel's default).

Anything this port does not implement (biases on in_proj/out_proj, no conv bias, a LayerNorm
instead of RMSNorm, another activation) is a one-line error naming the key.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

from recurrent_coreai.families import base, ssm
from recurrent_coreai.families.hparams import REQUIRED, HParams
from recurrent_coreai.util.errors import PipelineError

MAMBA, FALCON = "mamba", "falcon_mamba"   # the transformers model_type of each variant
FALCON_EPS = 1e-6                         # FalconMambaConfig.mixer_rms_eps's default

# config.yaml source.shape keys -> (type, default or REQUIRED); None: derived (intermediate =
# expand x hidden, dt_rank = ceil(hidden / 16))
SHAPE_KEYS: dict[str, tuple[type, object]] = {
    "layers": (int, REQUIRED), "hidden": (int, REQUIRED), "d_state": (int, REQUIRED), "vocab": (int, REQUIRED),
    "expand": (int, 2), "intermediate": (int, None), "dt_rank": (int, None), "conv_kernel": (int, 4),
    "norm_eps": (float, 1e-5), "tie_embeddings": (bool, False), "falcon": (bool, False),
    "mixer_eps": (float, FALCON_EPS),
}


def auto_dt_rank(hidden: int) -> int:
    """mamba_ssm's and transformers' ``dt_rank="auto"``: ceil(d_model / 16)."""
    return math.ceil(hidden / 16)


@dataclass(frozen=True)
class Geometry(base.Geometry):
    layers: int
    hidden: int          # d_model (C)
    d_state: int         # N
    vocab: int
    intermediate: int    # d_inner (I): the SSM's channels
    dt_rank: int         # R: the rank of the dt projection
    conv_kernel: int = 4  # K
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # the checkpoint ties lm_head to the embedding (the normal form holds both)
    falcon: bool = False          # Falcon Mamba: dt, B and C RMS-normalised (no weight) before use
    mixer_eps: float = FALCON_EPS  # that norm's eps (mixer_rms_eps); unused unless falcon

    @property
    def x_proj_width(self) -> int:  # dt | B | C
        return self.dt_rank + 2 * self.d_state

    @property
    def model_type(self) -> str:
        return FALCON if self.falcon else MAMBA

    def as_dict(self) -> dict:
        return asdict(self)

    def check(self, where: str | Path = "config") -> "Geometry":
        ssm.check_fields(self, where, ("tie_embeddings", "falcon"))
        return self


def geometry_from_shape(shape: Mapping, where: str | Path) -> Geometry:
    values = ssm.shape_values(shape, SHAPE_KEYS, "Mamba-1", where)
    expand = values.pop("expand")
    if not (isinstance(expand, int) and expand > 0):
        raise PipelineError(where, f"expand must be positive, got {expand!r}", "fix source.shape.expand")
    if values["intermediate"] is None:
        values["intermediate"] = expand * values["hidden"]
    elif "expand" in shape:
        raise PipelineError(where, "source.shape gives both expand and intermediate", "give one of them")
    if values["dt_rank"] is None:
        values["dt_rank"] = auto_dt_rank(values["hidden"])
    return Geometry(**values).check(where)


# --- config.json -----------------------------------------------------------------------------
PORT_FIX = "use a plain Mamba-1 checkpoint (or extend families/mamba1)"   # a setting this port does not implement


def _dt_rank(value: object, hidden: int, key: str, where: str | Path) -> int:
    if value is None or value == "auto":
        return auto_dt_rank(hidden)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PipelineError(where, f"{key} must be \"auto\" or a positive integer, got {value!r}",
                            f"fix {key} in config.json")
    return value


def geometry_from_hf_config(cfg: Mapping, where: str | Path) -> Geometry:
    falcon = cfg.get("model_type") == FALCON
    r = HParams(cfg, where, "use the config.json of a transformers MambaForCausalLM or FalconMambaForCausalLM "
                "checkpoint", "Mamba-1", PORT_FIX)
    ssm.require_plain_hf_mixer(r)
    hidden = r.whole("hidden_size")
    if r.has("intermediate_size"):
        intermediate = r.whole("intermediate_size")
    else:
        intermediate = r.whole("expand", default=2) * hidden
    return Geometry(
        layers=r.whole("num_hidden_layers"), hidden=hidden, d_state=r.whole("state_size"), vocab=r.whole("vocab_size"),
        intermediate=intermediate, dt_rank=_dt_rank(r.value("time_step_rank", default="auto"), hidden,
                                                    "time_step_rank", where),
        conv_kernel=r.whole("conv_kernel", default=4), norm_eps=r.number("layer_norm_epsilon", default=1e-5),
        tie_embeddings=r.flag("tie_word_embeddings", default=True),   # MambaConfig's default
        falcon=falcon, mixer_eps=r.number("mixer_rms_eps", default=FALCON_EPS) if falcon else FALCON_EPS,
    ).check(where)


# Mamba(...) keyword arguments; the ones that only shape the init or the CUDA path are ignored
SSM_CFG_KEYS = {"layer", "d_state", "d_conv", "expand", "dt_rank", "dt_min", "dt_max", "dt_init", "dt_scale",
                "dt_init_floor", "conv_bias", "bias", "use_fast_path"}


def geometry_from_mamba_ssm_config(cfg: Mapping, where: str | Path) -> Geometry:
    r = HParams(cfg, where, "use the config.json of a state-spaces/mamba-* checkpoint", "Mamba-1", PORT_FIX)
    ssm.require_plain_mamba_ssm(r)
    r.require("tie_embeddings", lambda v: v is True, True, "tie_embeddings true (MambaLMHeadModel ties the head)")
    r.require("norm_epsilon", lambda v: v == 1e-5, 1e-5, "norm_epsilon 1e-5 (MixerModel's)")
    s = r.section("ssm_cfg")
    s.only(SSM_CFG_KEYS)
    s.require("layer", lambda v: v == "Mamba1", "Mamba1", 'layer "Mamba1" (this is a Mamba-2 config)')
    s.require("bias", lambda v: v is False, False, "bias false")
    s.require("conv_bias", lambda v: v is True, True, "conv_bias true")
    hidden = r.whole("d_model")
    vocab = ssm.mamba_ssm_vocab(r)
    return Geometry(
        layers=r.whole("n_layer"), hidden=hidden, d_state=s.whole("d_state", default=16), vocab=vocab,
        intermediate=s.whole("expand", default=2) * hidden,
        dt_rank=_dt_rank(s.value("dt_rank", default="auto"), hidden, "ssm_cfg.dt_rank", where),
        conv_kernel=s.whole("d_conv", default=4), norm_eps=1e-5, tie_embeddings=True,
    ).check(where)


def geometry_from_config(cfg: object, where: str | Path) -> Geometry:
    HParams(cfg, where, "use the config.json of a Mamba-1 checkpoint")  # a JSON object, else one line
    if "d_model" in cfg and "model_type" not in cfg:
        return geometry_from_mamba_ssm_config(cfg, where)
    if cfg.get("model_type") not in (MAMBA, FALCON):
        raise PipelineError(where, f"model_type is {cfg.get('model_type')!r}, not 'mamba' or 'falcon_mamba' "
                            "(and no mamba_ssm d_model)", "point the source at a Mamba-1 checkpoint")
    return geometry_from_hf_config(cfg, where)


def hf_config(g: Geometry) -> dict:
    """config.json of the normal form (transformers MambaForCausalLM or FalconMambaForCausalLM;
    from_pretrained loads it). ``expand`` is stated only where it is whole (intermediate_size rules)."""
    cfg = {
        "architectures": ["FalconMambaForCausalLM" if g.falcon else "MambaForCausalLM"],
        "model_type": g.model_type,
        "hidden_size": g.hidden,
        "num_hidden_layers": g.layers,
        "state_size": g.d_state,
        "intermediate_size": g.intermediate,
        "time_step_rank": g.dt_rank,
        "conv_kernel": g.conv_kernel,
        "vocab_size": g.vocab,
        "layer_norm_epsilon": g.norm_eps,
        "tie_word_embeddings": g.tie_embeddings,
        "use_bias": False,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "residual_in_fp32": True,
        "pad_token_id": 0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "float32",
    }
    if g.intermediate % g.hidden == 0:
        cfg["expand"] = g.intermediate // g.hidden
    if g.falcon:
        cfg["mixer_rms_eps"] = g.mixer_eps
    return cfg


def mamba_ssm_config(g: Geometry) -> dict:
    """config.json as state-spaces/mamba-* write it (MambaConfig's fields); only a plain, tied
    Mamba-1 whose inner width is a whole multiple of d_model fits it."""
    if g.falcon or not g.tie_embeddings or g.intermediate % g.hidden or g.norm_eps != 1e-5:
        raise ValueError("the mamba-ssm layout holds only a plain Mamba-1 with a tied head, "
                         "intermediate = expand x hidden and norm eps 1e-5")
    return {
        "d_model": g.hidden, "d_intermediate": 0, "n_layer": g.layers, "vocab_size": g.vocab,
        "ssm_cfg": {"layer": "Mamba1", "d_state": g.d_state, "d_conv": g.conv_kernel,
                    "expand": g.intermediate // g.hidden, "dt_rank": g.dt_rank},
        "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
        "pad_vocab_size_multiple": 1, "tie_embeddings": True,
    }


STATE_NAMES = ssm.STATE_NAMES  # the buffers every function reads and writes once


def state_specs(g: Geometry) -> list[base.StateSpec]:
    """The bundle's states, in registration order: the decode module (export_modules) builds its
    buffers from these."""
    return ssm.state_specs(g, g.intermediate, "per layer: the last conv_kernel inputs of the depthwise conv "
                           "(the x half of in_proj), newest last", (g.intermediate, g.d_state),
                           "per layer and channel: the SSM state, intermediate x d_state")


def normal_shapes(g: Geometry) -> dict[str, tuple[int, ...]]:
    """The normal form (transformers names, lm_head always present), in file order."""
    I, N, R = g.intermediate, g.d_state, g.dt_rank
    return ssm.normal_shapes(g, 2 * I, I, {"x_proj.weight": (g.x_proj_width, I), "dt_proj.weight": (I, R),
                                           "dt_proj.bias": (I,), "A_log": (I, N), "D": (I,)})
