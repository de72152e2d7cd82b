"""RWKV-6 (x060) geometry and the normal form it implies (the names of ``RWKV/v6-Finch-*-HF``).

The LoRA widths (``mix_lora`` = BlinkDL's D_MIX / TIME_MIX_EXTRA_DIM, ``decay_lora`` = D_DECAY /
TIME_DECAY_EXTRA_DIM) are not fixed: BlinkDL's training code and the HF remote code double them
at n_embd 4096 (32/64 -> 64/128). They are read off the tensors wherever tensors are at hand
(:func:`geometry_from_tensors`); a config.json without explicit keys for them gets the HF remote
code's own rule, and a mismatch with the weights is then a one-line shape error naming the tensor.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping

from recurrent_coreai.families import base
from recurrent_coreai.families.hparams import HParams
from recurrent_coreai.util.errors import PipelineError

MIX = ("w", "k", "v", "r", "g")            # order of the five ddlerp LoRA outputs (time_maa_w2's rows)
MAA = ("x", "w", "k", "v", "r", "g")       # attention.time_maa_<m> [1,1,C]
ATT_LINEARS = ("receptance", "key", "value", "gate", "output")
FFN_LINEARS = ("key", "receptance", "value")
HF_MODEL_TYPE = "rwkv6"

# ln_x, the GroupNorm over heads after the WKV. Its eps is 1e-5 * head_size_divisor**2 in BlinkDL's x060
# (RWKV-LM RWKV-v5/src/model.py, RWKV_Tmix_x060: ``eps=(1e-5)*(args.head_size_divisor**2)``, the
# trainer's --head_size_divisor defaulting to 8 whatever --head_size_a is) and in the HF remote code of
# RWKV/v6-Finch-*-HF (``eps=(1e-5)*(config.head_size_divisor**2)``); the rwkv package writes 64e-5
# literally. It depends on neither the head size nor layer_norm_epsilon (x052 divided the WKV output by
# head_size_divisor before a GroupNorm of eps 1e-5: the same function). The one place it is computed.
LN_X_EPS_UNIT = 1e-5
HEAD_SIZE_DIVISOR = 8  # the official default; a BlinkDL .pth cannot state another, an HF config.json may


def ln_x_eps(head_size_divisor: int = HEAD_SIZE_DIVISOR) -> float:
    """ln_x's GroupNorm eps: 1e-5 * head_size_divisor**2 (64e-5 for the official divisor 8)."""
    return LN_X_EPS_UNIT * head_size_divisor ** 2


@dataclass(frozen=True)
class Geometry(base.Geometry):
    layers: int
    hidden: int
    ffn: int
    vocab: int
    head_dim: int = 64
    mix_lora: int = 32
    decay_lora: int = 64
    norm_eps: float = 1e-5
    head_size_divisor: int = HEAD_SIZE_DIVISOR  # sets ln_x's eps only (:func:`ln_x_eps`); from config.json

    @property
    def heads(self) -> int:
        return self.hidden // self.head_dim

    @property
    def ln_x_eps(self) -> float:
        """ln_x (GroupNorm per head) eps: :func:`ln_x_eps` of this geometry's head_size_divisor."""
        return ln_x_eps(self.head_size_divisor)

    def as_dict(self) -> dict:
        """The record's geometry; head_size_divisor only when it is not the official 8, so that the
        records of every model with the official divisor stay what they were."""
        d = super().as_dict()
        if d["head_size_divisor"] == HEAD_SIZE_DIVISOR:
            del d["head_size_divisor"]
        return d

    def check(self, where: str | Path = "config") -> "Geometry":
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise PipelineError(where, f"{f.name} must be positive, got {value!r}", "fix the model shape")
            if f.name != "norm_eps" and not isinstance(value, int):
                raise PipelineError(where, f"{f.name} must be an integer, got {value!r}", "fix the model shape")
        if self.hidden % self.head_dim:
            raise PipelineError(where, f"hidden {self.hidden} is not a multiple of head_dim {self.head_dim}",
                                "choose a hidden size divisible by the head size (64 for RWKV-6)")
        return self


def normal_shapes(g: Geometry) -> dict[str, tuple[int, ...]]:
    """Every tensor of the normal form (the HF remote-code layout of ``RWKV/v6-Finch-*-HF``),
    name -> shape, in the order that model registers its parameters."""
    C, H, N, F, V = g.hidden, g.heads, g.head_dim, g.ffn, g.vocab
    s: dict[str, tuple[int, ...]] = {"rwkv.embeddings.weight": (V, C)}
    for i in range(g.layers):
        p = f"rwkv.blocks.{i}."
        norms = ("pre_ln", "ln1", "ln2") if i == 0 else ("ln1", "ln2")
        for n in norms:
            s[f"{p}{n}.weight"] = (C,)
            s[f"{p}{n}.bias"] = (C,)
        a = p + "attention."
        for m in MAA:
            s[f"{a}time_maa_{m}"] = (1, 1, C)
        s[a + "time_maa_w1"] = (C, len(MIX) * g.mix_lora)
        s[a + "time_maa_w2"] = (len(MIX), g.mix_lora, C)
        s[a + "time_decay"] = (1, 1, C)
        s[a + "time_decay_w1"] = (C, g.decay_lora)
        s[a + "time_decay_w2"] = (g.decay_lora, C)
        s[a + "time_faaaa"] = (H, N)
        for lin in ATT_LINEARS:
            s[f"{a}{lin}.weight"] = (C, C)
        s[a + "ln_x.weight"] = (C,)
        s[a + "ln_x.bias"] = (C,)
        f = p + "feed_forward."
        s[f + "time_maa_k"] = (1, 1, C)
        s[f + "time_maa_r"] = (1, 1, C)
        s[f + "key.weight"] = (F, C)
        s[f + "receptance.weight"] = (C, C)
        s[f + "value.weight"] = (C, F)
    s["rwkv.ln_out.weight"] = (C,)
    s["rwkv.ln_out.bias"] = (C,)
    s["head.weight"] = (V, C)
    return s


STATE_NAMES = ("recState", "shiftState")  # the buffers every function reads and writes once


def state_specs(g: Geometry) -> list[base.StateSpec]:
    """The bundle's states, in registration order: the decode module (export_modules) builds its
    buffers from these."""
    L, H, N, C = g.layers, g.heads, g.head_dim, g.hidden
    rec, shift = STATE_NAMES
    return [
        base.StateSpec(rec, (L, 1, H, N, N), "[layer, batch, head, key, value]: the WKV matrix state per head"),
        base.StateSpec(shift, (L, 1, 2, C), "[layer, batch, slot, channel]: previous token's LN1 output "
                       "(slot 0, time mix) and LN2 output (slot 1, channel mix)"),
    ]


def parameter_count(g: Geometry) -> int:
    return sum(math.prod(v) for v in normal_shapes(g).values())


# --- config.yaml source.shape ----------------------------------------------------------------
SHAPE_KEYS = ("layers", "hidden", "head_dim", "ffn", "vocab", "mix_lora", "decay_lora")  # all required


def geometry_from_shape(family, shape: Mapping, where: str | Path) -> Geometry:
    """Exactly :data:`SHAPE_KEYS`, positive integers (``base.shape_to``): the LoRA widths are
    named, never assumed; norm_eps is RWKV-6's 1e-5."""
    return base.shape_to(Geometry, family, shape, where)


def geometry_from_dict(d: Mapping) -> Geometry:
    return Geometry(**{f.name: d[f.name] for f in fields(Geometry) if f.name in d})


# --- config.json (HF remote code, RWKV/v6-Finch-*-HF) ------------------------------------------
def geometry_from_config(cfg, where: str | Path) -> Geometry:
    """config.json of the HF remote-code layout. Keys: hidden_size, num_hidden_layers, vocab_size,
    head_size (64), intermediate_size (null -> int(hidden*3.5)//32*32, as that code derives it),
    layer_norm_epsilon (1e-5: the LayerNorms' eps only), head_size_divisor (8; ln_x eps = 1e-5 *
    head_size_divisor**2 whatever head_size is, :func:`ln_x_eps`), attention_hidden_size (must equal
    hidden_size); LoRA widths from time_mix_extra_dim / time_decay_extra_dim when present, else the
    remote code's rule (doubled at hidden 4096)."""
    r = HParams(cfg, where, "use the config.json of an RWKV-6 checkpoint in the RWKV/v6-Finch-*-HF layout")
    if cfg.get("model_type") != HF_MODEL_TYPE:
        raise PipelineError(where, f"model_type is {cfg.get('model_type')!r}, not {HF_MODEL_TYPE!r}",
                            "point the source at an RWKV-6 (x060) checkpoint")
    hidden = r.whole("hidden_size")
    eps = r.number("layer_norm_epsilon", default=1e-5)
    head = r.whole("head_size", default=64)
    if r.whole("attention_hidden_size", default=hidden) != hidden:
        raise PipelineError(where, f"attention_hidden_size {cfg['attention_hidden_size']} differs from hidden_size "
                            f"{hidden}", "only RWKV-6 models with attention_hidden_size == hidden_size are supported")
    divisor = r.whole("head_size_divisor", default=HEAD_SIZE_DIVISOR)  # the remote code's ln_x eps, taken as written
    default_ffn = int((hidden * 3.5) // 32 * 32)
    return Geometry(
        layers=r.whole("num_hidden_layers"), hidden=hidden, ffn=r.whole("intermediate_size", default=default_ffn),
        vocab=r.whole("vocab_size"), head_dim=head,
        mix_lora=r.whole("time_mix_extra_dim", default=64 if hidden == 4096 else 32),
        decay_lora=r.whole("time_decay_extra_dim", default=128 if hidden == 4096 else 64),
        norm_eps=eps, head_size_divisor=divisor,
    ).check(where)


def config_json(g: Geometry) -> dict:
    """config.json as RWKV/v6-Finch-1B6-HF writes it, plus the LoRA widths (time_mix_extra_dim,
    time_decay_extra_dim), which its remote code hard-codes but a reader here takes when present."""
    return {
        "architectures": ["Rwkv6ForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_rwkv6.Rwkv6Config",
                     "AutoModelForCausalLM": "modeling_rwkv6.Rwkv6ForCausalLM"},
        "model_type": HF_MODEL_TYPE,
        "attention_hidden_size": g.hidden,
        "head_size": g.head_dim,
        "head_size_divisor": g.head_size_divisor,
        "hidden_size": g.hidden,
        "intermediate_size": g.ffn,
        "layer_norm_epsilon": g.norm_eps,
        "num_attention_heads": g.heads,
        "num_hidden_layers": g.layers,
        "rescale_every": 6,
        "tie_word_embeddings": False,
        "time_mix_extra_dim": g.mix_lora,
        "time_decay_extra_dim": g.decay_lora,
        "vocab_size": g.vocab,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": True,
        "torch_dtype": "float32",
    }


# --- geometry read off tensor shapes (BlinkDL .pth has no config.json) ---------------------------
def geometry_from_tensors(shapes: Mapping[str, tuple[int, ...]], names: Mapping[str, str], layout_label: str,
                          where: str | Path) -> Geometry:
    """``names`` maps the normal-form names used here to the layout's own names."""
    def shape(key: str, dims: int) -> tuple[int, ...]:
        name = names[key]
        if name not in shapes:
            raise PipelineError(where, f"tensor {name} is missing", f"use a complete RWKV-6 x060 {layout_label}")
        s = tuple(shapes[name])
        if len(s) != dims:
            raise PipelineError(where, f"tensor {name} has shape {list(s)}, expected {dims} dimensions",
                                f"the {layout_label} is not a consistent RWKV-6 x060 checkpoint")
        return s

    vocab, hidden = shape("emb", 2)
    heads, head_dim = shape("faaaa", 2)
    ffn = shape("ffn_key", 2)[0]
    mix5 = shape("maa_w1", 2)[1]
    if mix5 % len(MIX):
        raise PipelineError(where, f"tensor {names['maa_w1']} has {mix5} columns, not a multiple of 5",
                            f"the {layout_label} is not a consistent RWKV-6 x060 checkpoint")
    decay = shape("decay_w1", 2)[1]
    block = re.compile(names["block_re"])
    layers = 1 + max((int(m.group(1)) for n in shapes if (m := block.match(n))), default=-1)
    if heads * head_dim != hidden:
        raise PipelineError(where, f"tensor {names['faaaa']} has shape {[heads, head_dim]}, heads x head size "
                            f"!= hidden {hidden}", f"the {layout_label} is not a consistent RWKV-6 x060 checkpoint")
    return Geometry(layers=layers, hidden=hidden, ffn=ffn, vocab=vocab, head_dim=head_dim,
                    mix_lora=mix5 // len(MIX), decay_lora=decay).check(where)
