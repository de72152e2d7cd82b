"""The export graph: RWKV-7 as an ``nn.Module`` whose two states are mutated buffers.

Decode (:class:`RWKV7Decode`): ``input_ids`` [1,1] int32, ``position_ids`` [1,1] int32 (accepted, unused),
returns ``logits`` [1,1,V]; states ``recState`` [L,1,H,N,N] (fla orientation, [K,V] per head)
and ``shiftState`` [L,1,2,C] (slot 0 time-mix, slot 1 channel-mix).

Rules that the device delegates taught the shipped port, kept here:
* every layer returns its new state slices; each state gets ONE write per step, at the end;
* the L2 norm is written out with an explicit eps (no ``F.normalize``);
* the decay, its exp and the kk normalisation are computed in fp32 (at least), whatever the recipe dtype;
* every matmul sums in fp32 at least (Core AI's Linux runtime sums an fp16 ``batch_matmul`` in
  fp16): the linears (:func:`linear`) as 1x1 convolutions in fp16 graphs, the decode recurrence
  in fp32 whatever the state's dtype; weights are used as stored (never transposed per call).

Prefill (:class:`RWKV7Prefill`): ``input_ids`` [1,T] int32 (T static, ``coreai.stateful.PREFILL_CHUNK``
by default), ``position_ids`` [1,T] (unused), returns the logits of the LAST position [1,1,V];
reads and writes the same two states, once each. It is built over the decode module's own
submodules (same parameter names, so weights are stored once in a bundle holding both functions,
and a quantised decode module gives a quantised prefill). The bundle's function names and roles
are the rows of :data:`.entrypoints.ENTRY_POINTS`.

The per-layer math lives in ONE function, :meth:`Block.step`, over explicit state slices and T
tokens: token shift, projections, LoRAs, norms and FFN are shared; only the WKV differs — the
recurrence for T = 1 (decode), the exact chunked form of :mod:`.chunked` for T > 1.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from recurrent_coreai.coreai import stateful
from recurrent_coreai.coreai.layers import last_row, linear, token_shift, wide
from recurrent_coreai.families.rwkv7 import chunked
from recurrent_coreai.families.rwkv7.geometry import STATE_NAMES  # noqa: F401 - the buffers' names, for tests
from recurrent_coreai.families.rwkv7.geometry import MIXERS, Geometry, state_specs

NEG_EXP_HALF = -math.exp(-0.5)


class LoRA(nn.Module):
    """fla's LoRA: Linear(C->D, no bias) -> act -> Linear(D->C, bias?) under ``lora.0``/``lora.2``."""

    def __init__(self, c: int, d: int, act: nn.Module, bias: bool):
        super().__init__()
        self.lora = nn.Sequential(nn.Linear(c, d, bias=False), act, nn.Linear(d, c, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down, act, up = self.lora
        return linear(up, act(linear(down, x)))


class Attn(nn.Module):
    def __init__(self, g: Geometry, layer: int):
        super().__init__()
        C, H, N = g.hidden, g.heads, g.head_dim
        for m in MIXERS:
            self.register_parameter(f"x_{m}", nn.Parameter(torch.zeros(1, 1, C)))
        self.k_k = nn.Parameter(torch.zeros(C))
        self.k_a = nn.Parameter(torch.zeros(C))
        self.r_k = nn.Parameter(torch.zeros(H, N))
        self.r_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(C, C, bias=False) for _ in range(4))
        self.w_lora = LoRA(C, g.decay_lora, nn.Tanh(), bias=True)
        self.a_lora = LoRA(C, g.a_lora, nn.Identity(), bias=True)
        if layer > 0:
            self.v_lora = LoRA(C, g.v_lora, nn.Identity(), bias=True)
        self.g_lora = LoRA(C, g.gate_lora, nn.Sigmoid(), bias=False)
        self.g_norm = nn.GroupNorm(H, C, eps=g.g_norm_eps)


class FFN(nn.Module):
    def __init__(self, g: Geometry):
        super().__init__()
        self.x_k = nn.Parameter(torch.zeros(g.hidden))
        self.key = nn.Linear(g.hidden, g.ffn, bias=False)
        self.value = nn.Linear(g.ffn, g.hidden, bias=False)


class Block(nn.Module):
    def __init__(self, g: Geometry, layer: int):
        super().__init__()
        self.g, self.layer = g, layer
        if layer == 0:
            self.pre_norm = nn.LayerNorm(g.hidden, eps=g.norm_eps)
        self.attn_norm = nn.LayerNorm(g.hidden, eps=g.norm_eps)
        self.ffn_norm = nn.LayerNorm(g.hidden, eps=g.norm_eps)
        self.attn = Attn(g, layer)
        self.ffn = FFN(g)

    def step(self, x, att_prev, ffn_prev, S, v_first):
        """T tokens through the layer (T = x.shape[0], static; decode runs T = 1).

        x, v_first: [T,C]; att_prev, ffn_prev: [1,C] (the shift rows before the first token);
        S: [1,H,K,V]. Returns x, the last token's new att/ffn shift rows [1,C], the new S, v_first.
        T = 1 runs the recurrence itself; T > 1 the exact chunked form (:mod:`.chunked`). Everything
        else (token shift, projections, LoRAs, norms, FFN) is this one code path for both.
        """
        T = x.shape[0]
        H, N = self.g.heads, self.g.head_dim
        at = self.attn
        if self.layer == 0:
            x = self.pre_norm(x)
        h = self.attn_norm(x)
        d = token_shift(att_prev, h) - h
        xr, xw, xk, xv, xa, xg = (h + d * getattr(at, f"x_{m}").reshape(1, -1) for m in MIXERS)
        r, k, v = linear(at.r_proj, xr), linear(at.k_proj, xk), linear(at.v_proj, xv)
        logw = NEG_EXP_HALF * torch.sigmoid(at.w_lora(xw).to(wide(x.dtype)))
        if self.layer == 0:
            v_first = v
        else:
            v = v + (v_first - v) * torch.sigmoid(at.v_lora(xv))
        a = torch.sigmoid(at.a_lora(xa))
        gate = at.g_lora(xg)
        kk = (k * at.k_k).to(wide(k.dtype)).reshape(T, H, N)
        kk = kk * torch.rsqrt((kk * kk).sum(-1, keepdim=True) + 1e-12)  # explicit L2 norm with eps
        k = k * (1 + (a - 1) * at.k_a)
        if T == 1:
            # in at least fp32 whatever the state's dtype, as the chunked prefill: the runtime
            # accumulates an fp16 matmul in fp16 (see linear)
            dt = wide(S.dtype)
            S0 = S.to(dt)
            decay = torch.exp(logw).reshape(1, H, N, 1).to(dt)
            kk = kk.to(dt)
            kka = (kk * a.reshape(1, H, N).to(dt)).reshape(1, H, N, 1)
            kh, vh, rh = k.reshape(1, H, N, 1).to(dt), v.reshape(1, H, 1, N).to(dt), r.reshape(1, H, N, 1).to(dt)
            kkS = torch.matmul(kk.reshape(1, H, 1, N), S0)                # [1,H,1,V]
            S_new = decay * S0 - torch.matmul(kka, kkS) + torch.matmul(kh, vh)
            o = torch.matmul(S_new.transpose(-1, -2), rh).reshape(1, H * N).to(x.dtype)
            S_new = S_new.to(S.dtype)
        else:
            heads = (t.reshape(T, H, N).transpose(0, 1) for t in (r, k, v, kk, a, logw))   # [H,T,N]
            o, S_new = chunked.wkv_chunk(*heads, S.reshape(H, N, N))
            o, S_new = o.transpose(0, 1).reshape(T, H * N).to(x.dtype), S_new.reshape(1, H, N, N)
        o = at.g_norm(o)
        bonus = (r.reshape(T, H, N) * k.reshape(T, H, N) * at.r_k).sum(-1, keepdim=True) * v.reshape(T, H, N)
        o = o + bonus.reshape(T, H * N)
        x = x + linear(at.o_proj, o * gate)
        h2 = self.ffn_norm(x)
        ffn_prev = token_shift(ffn_prev, h2)
        kx = h2 + (ffn_prev - h2) * self.ffn.x_k
        x = x + linear(self.ffn.value, torch.relu(linear(self.ffn.key, kx)) ** 2)
        return x, last_row(h), last_row(h2), S_new, v_first


class Backbone(nn.Module):
    def __init__(self, g: Geometry):
        super().__init__()
        self.embeddings = nn.Embedding(g.vocab, g.hidden)
        self.layers = nn.ModuleList(Block(g, i) for i in range(g.layers))
        self.norm = nn.LayerNorm(g.hidden, eps=g.norm_eps)


def run_layers(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [T,C] through every layer of ``m.model`` from ``m``'s states; each layer returns its new
    slices and each state gets exactly ONE write, at the end. Returns x [T,C]."""
    v_first = x  # replaced by layer 0
    recs, shifts = [], []
    for i, block in enumerate(m.model.layers):
        x, att, ffn, S, v_first = block.step(x, m.shiftState[i, :, 0], m.shiftState[i, :, 1], m.recState[i], v_first)
        recs.append(S)
        shifts.append(torch.stack([att, ffn], dim=1))                  # [1,2,C]
    m.recState.copy_(torch.stack(recs))
    m.shiftState.copy_(torch.stack(shifts))
    return x


class RWKV7Decode(stateful.Decode):
    """The decode entry point: one token in, logits out, both states updated once."""

    def __init__(self, g: Geometry, dtype: torch.dtype = torch.float32):
        super().__init__(g, dtype, {"model": Backbone(g), "lm_head": nn.Linear(g.hidden, g.vocab, bias=False)},
                         state_specs(g))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        del position_ids  # RWKV has no positions; kept as an input for engine parity
        x = run_layers(self, self.model.embeddings(input_ids.reshape(1).to(torch.int64)))   # [1,C]
        logits = linear(self.lm_head, self.model.norm(x))
        return logits.reshape(1, 1, self.g.vocab)


class RWKV7Prefill(stateful.Prefill):
    """The prefill entry point: ``input_ids`` [1,T] (T static) in, logits of the LAST position
    [1,1,V] out, both states read and written once — the same states as decode.

    It holds the decode module's own submodules and state buffers (not copies, see
    :class:`~recurrent_coreai.coreai.stateful.Prefill`), so the parameter names are identical
    (``model.layers.0.attn.r_proj.weight`` …, ``lm_head.weight``).
    """

    max_chunk = chunked.MAX_CHUNK

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        del position_ids  # RWKV has no positions; kept as an input for engine parity
        x = run_layers(self, self.model.embeddings(input_ids.reshape(self.chunk).to(torch.int64)))   # [T,C]
        logits = linear(self.lm_head, self.model.norm(x[-1:]))
        return logits.reshape(1, 1, self.g.vocab)


def build_prefill(decode: RWKV7Decode, chunk: int = stateful.PREFILL_CHUNK) -> RWKV7Prefill:
    """The prefill module over ``decode``'s parameters and states (build or quantise decode first)."""
    return RWKV7Prefill(decode, chunk).eval()


def build_decode(weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], g: Geometry,
                 dtype: torch.dtype, each_linear: Callable[[str, nn.Linear], nn.Module] | None = None) -> RWKV7Decode:
    """The decode module with the (normalised, HF-named) weights loaded strictly: built on the meta
    device, each weight assigned as it comes, cast to ``dtype`` (:func:`~recurrent_coreai.coreai.stateful.build_on_meta`;
    ``each_linear`` replaces a Linear as soon as its weights are in)."""
    return stateful.build_on_meta(lambda: RWKV7Decode(g, dtype), weights, each_linear)
