"""RWKV-7 geometry and the exact Hugging Face (fla) parameter layout it implies."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Mapping

from recurrent_coreai.families import base
from recurrent_coreai.families.hparams import HParams
from recurrent_coreai.util.errors import PipelineError

MIXERS = ("r", "w", "k", "v", "a", "g")  # order of the packed attn.x_x rows
LORAS = {"w": "decay", "a": "a", "v": "v", "g": "gate"}

# ln_x (fla: attn.g_norm), the GroupNorm over heads after the WKV. BlinkDL's x070 fixes its eps at
# 64e-5 whatever the head size (RWKV-LM RWKV-v7 train_temp and demos: ``nn.GroupNorm(H, C, eps=64e-5)``;
# rwkv 0.8.32: ``eps = 64e-5``). fla's RWKV7Attention derives it, ``eps=self.head_dim*norm_eps``: the same
# value at head size 64 (every published RWKV-7), another elsewhere. The rule here: 64e-5 (BlinkDL
# .pth, synthetic weights); an fla config.json gets fla's rule unless it states G_NORM_EPS_KEY (which
# config_json writes exactly when the value is not fla's, so that fla-rule files stay as they were).
G_NORM_EPS = 64e-5
G_NORM_EPS_KEY = "g_norm_eps"


def fla_g_norm_eps(head_dim: int, norm_eps: float) -> float:
    """fla's g_norm eps for a config.json that states no other: head_dim * norm_eps."""
    return head_dim * norm_eps


@dataclass(frozen=True)
class Geometry(base.Geometry):
    layers: int
    hidden: int
    head_dim: int
    ffn: int
    vocab: int
    decay_lora: int
    a_lora: int
    v_lora: int
    gate_lora: int
    norm_eps: float = 1e-5
    g_norm_eps: float = G_NORM_EPS  # ln_x / g_norm eps (see G_NORM_EPS); norm_eps is the LayerNorms'

    @property
    def heads(self) -> int:
        return self.hidden // self.head_dim

    def lora_dim(self, which: str) -> int:
        return getattr(self, f"{LORAS[which]}_lora")

    def check(self, where: str | Path = "config") -> "Geometry":
        for f in fields(self):  # positivity first: head_dim 0 must not reach the modulo below
            value = getattr(self, f.name)
            if value <= 0:
                raise PipelineError(where, f"{f.name} must be positive, got {value}", "fix the model shape")
        if self.hidden % self.head_dim:
            raise PipelineError(where, f"hidden_size {self.hidden} is not a multiple of head_dim {self.head_dim}",
                                "choose a hidden size divisible by the head size (64 for RWKV-7)")
        return self

    # --- Hugging Face config.json -------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: Mapping, where: str | Path = "config.json") -> "Geometry":
        r = HParams(cfg, where, "use the config.json of an fla/HF RWKV-7 checkpoint")
        if cfg.get("model_type") != "rwkv7":
            raise PipelineError(where, f"model_type is {cfg.get('model_type')!r}, not 'rwkv7'",
                                "point the source at an RWKV-7 (x070) checkpoint")
        hidden = r.whole("hidden_size")
        if r.has("intermediate_size"):
            ffn = r.whole("intermediate_size")
        else:  # fla derives it from hidden_ratio
            ffn = int(hidden * r.number("hidden_ratio", default=4.0))
        head_dim, norm_eps = r.whole("head_dim", default=64), r.number("norm_eps", default=1e-5)
        return cls(
            layers=r.whole("num_hidden_layers"),
            hidden=hidden,
            head_dim=head_dim,
            ffn=ffn,
            vocab=r.whole("vocab_size"),
            decay_lora=r.whole("decay_low_rank_dim"),
            a_lora=r.whole("a_low_rank_dim"),
            v_lora=r.whole("v_low_rank_dim"),
            gate_lora=r.whole("gate_low_rank_dim"),
            norm_eps=norm_eps,
            g_norm_eps=r.number(G_NORM_EPS_KEY, default=fla_g_norm_eps(head_dim, norm_eps)),
        ).check(where)

    def to_hf_config(self) -> dict:
        """config.json as the fla/HF RWKV-7 checkpoints write it (1.5B: RWKV/RWKV7-Goose-World3-1.5B-HF),
        plus G_NORM_EPS_KEY when g_norm_eps is not what fla derives from head_dim and norm_eps."""
        extra = {} if self.g_norm_eps == fla_g_norm_eps(self.head_dim, self.norm_eps) else {G_NORM_EPS_KEY: self.g_norm_eps}
        return {
            "architectures": ["RWKV7ForCausalLM"],
            "model_type": "rwkv7",
            "attn_mode": "chunk",
            "hidden_size": self.hidden,
            "hidden_ratio": self.ffn / self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "head_dim": self.head_dim,
            "num_heads": self.heads,
            "decay_low_rank_dim": self.decay_lora,
            "a_low_rank_dim": self.a_lora,
            "v_low_rank_dim": self.v_lora,
            "gate_low_rank_dim": self.gate_lora,
            "hidden_act": "sqrelu",
            "norm_first": True,
            "norm_bias": True,
            "norm_eps": self.norm_eps,
            "fuse_norm": False,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab,
            "max_position_embeddings": 2048,
            "initializer_range": 0.006,
            "use_cache": True,
            # the HF repo's own values; they are library defaults and wrong for World (EOS is 0)
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float32",
            **extra,
        }

    def as_dict(self) -> dict:
        """The record's geometry; g_norm_eps only when it is not BlinkDL's 64e-5, so that the records of
        every model with it (all at head size 64) stay what they were."""
        d = asdict(self)
        if d["g_norm_eps"] == G_NORM_EPS:
            del d["g_norm_eps"]
        return d


STATE_NAMES = ("recState", "shiftState")  # the buffers every function reads and writes once


def state_specs(g: Geometry) -> list[base.StateSpec]:
    """The bundle's states, in registration order: the decode module (export_graph) builds its
    buffers from these."""
    L, H, N, C = g.layers, g.heads, g.head_dim, g.hidden
    rec, shift = STATE_NAMES
    return [base.StateSpec(rec, (L, 1, H, N, N),
                           "[layers, batch, heads, K, V]: per layer and head, the K x V recurrent matrix "
                           "(fla orientation)"),
            base.StateSpec(shift, (L, 1, 2, C),
                           "[layers, batch, 2, hidden]: per layer, slot 0 = previous token for time-mix, "
                           "slot 1 = for channel-mix")]


def expected_shapes(g: Geometry) -> dict[str, tuple[int, ...]]:
    """Every tensor of the split-mixer fla layout, name -> shape."""
    C, H, N, F = g.hidden, g.heads, g.head_dim, g.ffn
    shapes: dict[str, tuple[int, ...]] = {"model.embeddings.weight": (g.vocab, C)}
    for i in range(g.layers):
        p = f"model.layers.{i}."
        if i == 0:
            shapes[p + "pre_norm.weight"] = (C,)
            shapes[p + "pre_norm.bias"] = (C,)
        for norm in ("attn_norm", "ffn_norm"):
            shapes[f"{p}{norm}.weight"] = (C,)
            shapes[f"{p}{norm}.bias"] = (C,)
        for m in MIXERS:
            shapes[f"{p}attn.x_{m}"] = (1, 1, C)
        shapes[p + "attn.k_k"] = (C,)
        shapes[p + "attn.k_a"] = (C,)
        shapes[p + "attn.r_k"] = (H, N)
        for proj in ("r", "k", "v", "o"):
            shapes[f"{p}attn.{proj}_proj.weight"] = (C, C)
        for which in ("w", "a", "v", "g"):
            if which == "v" and i == 0:
                continue
            d = g.lora_dim(which)
            shapes[f"{p}attn.{which}_lora.lora.0.weight"] = (d, C)
            shapes[f"{p}attn.{which}_lora.lora.2.weight"] = (C, d)
            if which != "g":
                shapes[f"{p}attn.{which}_lora.lora.2.bias"] = (C,)
        shapes[p + "attn.g_norm.weight"] = (C,)
        shapes[p + "attn.g_norm.bias"] = (C,)
        shapes[p + "ffn.x_k"] = (C,)
        shapes[p + "ffn.key.weight"] = (F, C)
        shapes[p + "ffn.value.weight"] = (C, F)
    shapes["model.norm.weight"] = (C,)
    shapes["model.norm.bias"] = (C,)
    shapes["lm_head.weight"] = (g.vocab, C)
    return shapes
