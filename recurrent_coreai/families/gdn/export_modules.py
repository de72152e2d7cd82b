"""The export graph: Gated DeltaNet as ``nn.Module``s whose four states are mutated buffers.

Decode (:class:`GDNDecode`): ``input_ids`` [1,1] int32, ``position_ids`` [1,1] int32 (accepted,
unused), returns ``logits`` [1,1,V]; states ``convQState``/``convKState`` [L,1,key_dim,conv_size],
``convVState`` [L,1,value_dim,conv_size] (the last conv_size inputs of each short conv, newest
last: fla's cache layout) and ``recurrentState`` [L,1,Hv,K,V] (key rows, value columns; fla >= 0.5.2
keeps it [V,K]).

Prefill (:class:`GDNPrefill`): ``input_ids`` [1,T] (T static), logits of the LAST position; over
the decode module's own submodules and buffers (weights stored once).

As in the other families: each state ONE write per call, at the end; every linear through
:func:`~recurrent_coreai.coreai.layers.linear`; the convs, norms, decay and the delta rule in at
least fp32 (:func:`~recurrent_coreai.coreai.layers.wide`), whatever the recipe dtype, and the
residual stream too; the per-layer math is ONE function (:meth:`Block.step`) over T tokens: only
the delta rule differs, :func:`.recurrence.delta_step` for T = 1 and the exact chunk form
:func:`.recurrence.chunk` for T > 1.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from recurrent_coreai.coreai import stateful
from recurrent_coreai.coreai.layers import linear, short_conv, wide
from recurrent_coreai.families.gdn import recurrence as rec
from recurrent_coreai.families.gdn.geometry import MAX_CHUNK, STATE_NAMES, Geometry, state_specs


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))


class Conv(nn.Module):
    """A short conv's weight [D,1,K] (no bias); not an nn.Conv1d, so no quantiser takes it."""

    def __init__(self, width: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width, 1, kernel))


class Attn(nn.Module):
    def __init__(self, g: Geometry):
        super().__init__()
        C, Dk, Dv = g.hidden, g.key_dim, g.value_dim
        self.q_proj = nn.Linear(C, Dk, bias=False)
        self.k_proj = nn.Linear(C, Dk, bias=False)
        self.v_proj = nn.Linear(C, Dv, bias=False)
        self.a_proj = nn.Linear(C, g.hv, bias=False)
        self.b_proj = nn.Linear(C, g.hv, bias=False)
        self.A_log = nn.Parameter(torch.zeros(g.hv))
        self.dt_bias = nn.Parameter(torch.zeros(g.hv))
        self.q_conv1d = Conv(Dk, g.conv_size)
        self.k_conv1d = Conv(Dk, g.conv_size)
        self.v_conv1d = Conv(Dv, g.conv_size)
        if g.use_gate:
            self.g_proj = nn.Linear(C, Dv, bias=False)
        self.o_norm = RMSNorm(g.head_v_dim)
        self.o_proj = nn.Linear(Dv, C, bias=False)


class MLP(nn.Module):
    def __init__(self, g: Geometry):
        super().__init__()
        self.gate_proj = nn.Linear(g.hidden, g.intermediate, bias=False)
        self.up_proj = nn.Linear(g.hidden, g.intermediate, bias=False)
        self.down_proj = nn.Linear(g.intermediate, g.hidden, bias=False)


class Block(nn.Module):
    def __init__(self, g: Geometry):
        super().__init__()
        self.g = g
        self.attn_norm = RMSNorm(g.hidden)
        self.attn = Attn(g)
        self.mlp_norm = RMSNorm(g.hidden)
        self.mlp = MLP(g)

    def step(self, x: torch.Tensor, cq: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, S: torch.Tensor):
        """T tokens through the layer. x [T,C] (wide dtype, the residual stream); cq, ck, cv [D,K]
        and S [Hv,K,V] the state slices before them. Returns x and the four new slices, in the states'
        dtype."""
        g, a = self.g, self.attn
        T = x.shape[0]
        H, Hv, K, V = g.heads, g.hv, g.head_dim, g.head_v_dim
        dtype, wd = S.dtype, x.dtype
        h = (_rms(x, g.norm_eps) * self.attn_norm.weight.to(wd)).to(dtype)
        q, cq_new = short_conv(cq, linear(a.q_proj, h), a.q_conv1d.weight, None, wd)
        k, ck_new = short_conv(ck, linear(a.k_proj, h), a.k_conv1d.weight, None, wd)
        v, cv_new = short_conv(cv, linear(a.v_proj, h), a.v_conv1d.weight, None, wd)
        q = rec.l2norm(F.silu(q).reshape(T, H, K)) * (1.0 / math.sqrt(K))
        k = rec.l2norm(F.silu(k).reshape(T, H, K))
        v = F.silu(v).reshape(T, Hv, V)
        decay = rec.gate(linear(a.a_proj, h).to(wd), a.A_log.to(wd), a.dt_bias.to(wd))       # [T,Hv]
        strength = rec.beta(linear(a.b_proj, h).to(wd), g.allow_neg_eigval)                   # [T,Hv]
        S0 = S.to(wd)
        if T == 1:
            o, S_new = rec.delta_step(S0, rec.heads_of(q.reshape(H, K), Hv, 0), rec.heads_of(k.reshape(H, K), Hv, 0),
                                      v.reshape(Hv, V), decay.reshape(Hv), strength.reshape(Hv))
            o = o.reshape(1, Hv, V)
        else:
            o, S_new = rec.chunk(S0, rec.heads_of(q.transpose(0, 1), Hv, 0), rec.heads_of(k.transpose(0, 1), Hv, 0),
                                 v.transpose(0, 1), decay.transpose(0, 1), strength.transpose(0, 1))
            o = o.transpose(0, 1)                                                              # [T,Hv,V]
        o = _rms(o, g.norm_eps) * a.o_norm.weight.to(wd)
        if g.use_gate:
            o = o * F.silu(linear(a.g_proj, h).to(wd).reshape(T, Hv, V))
        x = x + linear(a.o_proj, o.reshape(T, Hv * V).to(dtype)).to(wd)
        m = (_rms(x, g.norm_eps) * self.mlp_norm.weight.to(wd)).to(dtype)
        mlp = self.mlp
        act = F.silu(linear(mlp.gate_proj, m).to(wd)) * linear(mlp.up_proj, m).to(wd)
        x = x + linear(mlp.down_proj, act.to(dtype)).to(wd)
        return x, cq_new.to(cq.dtype), ck_new.to(ck.dtype), cv_new.to(cv.dtype), S_new.to(S.dtype)


class Model(nn.Module):
    def __init__(self, g: Geometry):
        super().__init__()
        self.embeddings = nn.Embedding(g.vocab, g.hidden)
        self.layers = nn.ModuleList(Block(g) for _ in range(g.layers))
        self.norm = RMSNorm(g.hidden)


def run(m: nn.Module, input_ids: torch.Tensor, T: int) -> torch.Tensor:
    """Logits [1,1,V] of the last of T tokens; each state written ONCE, at the end."""
    g = m.g
    dtype = m.recurrentState.dtype
    wd = wide(dtype)
    x = m.model.embeddings(input_ids.reshape(T).to(torch.int64)).to(wd)
    new: dict[str, list[torch.Tensor]] = {n: [] for n in STATE_NAMES}
    for i, block in enumerate(m.model.layers):
        x, cq, ck, cv, S = block.step(x, m.convQState[i, 0], m.convKState[i, 0], m.convVState[i, 0],
                                      m.recurrentState[i, 0])
        for name, t in zip(new, (cq, ck, cv, S)):
            new[name].append(t.unsqueeze(0))
    for name, parts in new.items():
        getattr(m, name).copy_(torch.stack(parts))
    last = x if T == 1 else x[-1:]
    h = (_rms(last, g.norm_eps) * m.model.norm.weight.to(wd)).to(dtype)
    return linear(m.lm_head, h).reshape(1, 1, g.vocab)


class GDNDecode(stateful.Decode):
    """The decode entry point: one token in, logits out, every state updated once."""

    def __init__(self, g: Geometry, dtype: torch.dtype = torch.float32):
        super().__init__(g, dtype, {"model": Model(g), "lm_head": nn.Linear(g.hidden, g.vocab, bias=False)},
                         state_specs(g))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        del position_ids  # no positions in a recurrence; kept as an input for engine parity
        return run(self, input_ids, 1)


class GDNPrefill(stateful.Prefill):
    """The prefill entry point: ``input_ids`` [1,T] (T static) in, the last position's logits out."""

    max_chunk = MAX_CHUNK

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        del position_ids
        return run(self, input_ids, self.chunk)


def build_prefill(decode: GDNDecode, chunk: int = stateful.PREFILL_CHUNK) -> GDNPrefill:
    return GDNPrefill(decode, chunk).eval()


def build_decode(weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], g: Geometry,
                 dtype: torch.dtype, each_linear: Callable[[str, nn.Linear], nn.Module] | None = None) -> GDNDecode:
    """The decode module with the normal-form weights loaded strictly (built on the meta device, each
    weight assigned as it comes; ``each_linear`` replaces a Linear once its weight is in)."""
    return stateful.build_on_meta(lambda: GDNDecode(g, dtype), weights, each_linear)
