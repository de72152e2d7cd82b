"""The export modules: RWKV-6 (x060) decode and prefill as ``nn.Module``s whose two states are
mutated buffers.

Decode (:class:`Rwkv6Decode`): ``input_ids`` [1,1] int32, ``position_ids`` [1,1] int32 (accepted,
unused) -> ``logits`` [1,1,V]; states ``recState`` [L,1,H,N,N] ([K,V] per head, as the rwkv
package's ``state[3i+1]`` and fla) and ``shiftState`` [L,1,2,C] (slot 0 = LN1 output for the time
mix, slot 1 = LN2 output for the channel mix). Prefill (:class:`Rwkv6Prefill`): ``input_ids``
[1,T] -> the logits of the LAST position [1,1,V], over the decode module's own submodules and
buffers (same parameter names: weights stored once in a bundle holding both).

Rules the device taught the RWKV-7 port, kept here:
* each layer returns its new state slices; each state gets ONE write per call, at the end;
* every linear goes through :func:`coreai.layers.linear` (fp32 sums on Core AI's Linux runtime);
  the ddlerp and decay LoRAs are nn.Linear too (``maa_w1``, ``maa_w2.<0..4>``, ``decay_w1``,
  ``decay_w2``: the normal form's ``time_maa_w1`` [C,5D], ``time_maa_w2`` [5,D,C],
  ``time_decay_w1`` [C,Dd], ``time_decay_w2`` [Dd,C], transposed once at load), so a recipe can
  name or keep them;
* the decay logit, its exp(-exp(.)) and the whole recurrence in at least fp32
  (:func:`coreai.layers.wide`), whatever the graph's dtype; ``time_decay`` and ``time_faaaa`` are
  held in fp32 even in an fp16 graph (as the rwkv package does); ln_x (GroupNorm, eps g.ln_x_eps) in fp32;
* fp16 only, the rwkv package's guard against fp16 overflow of the residual stream (its
  ``RWKV_RESCALE_LAYER`` = 6): block i's ``attention.output`` and ``feed_forward.value`` divided
  by 2**(i // 6) at build time, x halved after every 6th block (:func:`build_decode`); nothing
  changes below 7 layers, nor in fp32 (docs/measurements/2026-12-01-rwkv6-fp16-rescale.md).
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from recurrent_coreai.coreai import stateful
from recurrent_coreai.coreai.layers import last_row, linear, token_shift, wide
from recurrent_coreai.families.rwkv6 import chunked
from recurrent_coreai.families.rwkv6.geometry import STATE_NAMES  # noqa: F401 - the buffers' names, for tests
from recurrent_coreai.families.rwkv6.geometry import ATT_LINEARS, MAA, MIX, Geometry, state_specs

RESCALE_EVERY = 6     # fp16 only: x halved after every 6th block, output/value of layer i divided by 2**(i//6)
RESCALED = ("attention.output.weight", "feed_forward.value.weight")
WIDE_PARAMS = ("time_decay", "time_faaaa")   # kept in fp32 (at least) in every graph


class Attention(nn.Module):
    def __init__(self, g: Geometry):
        super().__init__()
        C, H, N = g.hidden, g.heads, g.head_dim
        for m in MAA:
            self.register_parameter(f"time_maa_{m}", nn.Parameter(torch.zeros(1, 1, C)))
        self.maa_w1 = nn.Linear(C, len(MIX) * g.mix_lora, bias=False)
        self.maa_w2 = nn.ModuleList(nn.Linear(g.mix_lora, C, bias=False) for _ in MIX)
        self.time_decay = nn.Parameter(torch.zeros(1, 1, C))
        self.decay_w1 = nn.Linear(C, g.decay_lora, bias=False)
        self.decay_w2 = nn.Linear(g.decay_lora, C, bias=False)
        self.time_faaaa = nn.Parameter(torch.zeros(H, N))
        for name in ATT_LINEARS:
            setattr(self, name, nn.Linear(C, C, bias=False))
        self.ln_x = nn.GroupNorm(H, C, eps=g.ln_x_eps)


class FeedForward(nn.Module):
    def __init__(self, g: Geometry):
        super().__init__()
        self.time_maa_k = nn.Parameter(torch.zeros(1, 1, g.hidden))
        self.time_maa_r = nn.Parameter(torch.zeros(1, 1, g.hidden))
        self.key = nn.Linear(g.hidden, g.ffn, bias=False)
        self.receptance = nn.Linear(g.hidden, g.hidden, bias=False)
        self.value = nn.Linear(g.ffn, g.hidden, bias=False)


class Block(nn.Module):
    def __init__(self, g: Geometry, layer: int):
        super().__init__()
        self.g, self.layer = g, layer
        if layer == 0:
            self.pre_ln = nn.LayerNorm(g.hidden, eps=g.norm_eps)
        self.ln1 = nn.LayerNorm(g.hidden, eps=g.norm_eps)
        self.ln2 = nn.LayerNorm(g.hidden, eps=g.norm_eps)
        self.attention = Attention(g)
        self.feed_forward = FeedForward(g)

    def step(self, x, att_prev, ffn_prev, S):
        """T tokens through the layer (T = x.shape[0], static; decode runs T = 1).

        x: [T,C]; att_prev, ffn_prev: [1,C] (the shift rows before the first token); S: [1,H,K,V].
        Returns x, the last token's LN1 and LN2 rows [1,C] and the new S. Only the WKV differs
        between T = 1 (the recurrence) and T > 1 (:func:`.chunked.wkv6_chunk`)."""
        T = x.shape[0]
        g, at, ff = self.g, self.attention, self.feed_forward
        H, N, D = g.heads, g.head_dim, g.mix_lora
        if self.layer == 0:
            x = self.pre_ln(x)
        h = self.ln1(x)
        sx = token_shift(att_prev, h) - h
        lora = torch.tanh(linear(at.maa_w1, h + sx * at.time_maa_x.reshape(1, -1)))          # [T,5D]
        mixed = {m: h + sx * (getattr(at, f"time_maa_{m}").reshape(1, -1) + linear(at.maa_w2[j], lora[:, j * D:(j + 1) * D]))
                 for j, m in enumerate(MIX)}
        r, k, v = linear(at.receptance, mixed["r"]), linear(at.key, mixed["k"]), linear(at.value, mixed["v"])
        gate = F.silu(linear(at.gate, mixed["g"]))
        wd = wide(x.dtype)
        d = at.time_decay.reshape(1, -1).to(wd) + linear(at.decay_w2, torch.tanh(linear(at.decay_w1, mixed["w"]))).to(wd)
        logw = -torch.exp(d)                                                                  # [T,C], log w
        if T == 1:
            dt = wide(S.dtype)
            S0 = S.to(dt)
            kv = k.reshape(1, H, N, 1).to(dt) * v.reshape(1, H, 1, N).to(dt)                  # [1,H,K,V]
            u = at.time_faaaa.reshape(1, H, N, 1).to(dt)
            o = torch.matmul(r.reshape(1, H, 1, N).to(dt), u * kv + S0).reshape(1, H * N)
            S_new = (kv + torch.exp(logw).reshape(1, H, N, 1).to(dt) * S0).to(S.dtype)
        else:
            heads = (t.reshape(T, H, N).transpose(0, 1) for t in (r, k, v, logw))           # [H,T,N]
            o, S_new = chunked.wkv6_chunk(*heads, at.time_faaaa, S.reshape(H, N, N))
            o, S_new = o.transpose(0, 1).reshape(T, H * N), S_new.reshape(1, H, N, N)
        o = F.group_norm(o.to(wd), H, at.ln_x.weight.to(wd), at.ln_x.bias.to(wd), eps=at.ln_x.eps).to(x.dtype)
        x = x + linear(at.output, o * gate)
        h2 = self.ln2(x)
        sx2 = token_shift(ffn_prev, h2) - h2
        xk = h2 + sx2 * ff.time_maa_k.reshape(1, -1)
        xr = h2 + sx2 * ff.time_maa_r.reshape(1, -1)
        x = x + torch.sigmoid(linear(ff.receptance, xr)) * linear(ff.value, torch.relu(linear(ff.key, xk)) ** 2)
        return x, last_row(h), last_row(h2), S_new


class Backbone(nn.Module):
    def __init__(self, g: Geometry):
        super().__init__()
        self.embeddings = nn.Embedding(g.vocab, g.hidden)
        self.blocks = nn.ModuleList(Block(g, i) for i in range(g.layers))
        self.ln_out = nn.LayerNorm(g.hidden, eps=g.norm_eps)


def run_layers(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [T,C] through every block of ``m.rwkv`` from ``m``'s states; ONE write per state, at the end.
    In a rescaled module (fp16) x is halved after every ``m.rescale_every``-th block."""
    recs, shifts = [], []
    for i, block in enumerate(m.rwkv.blocks):
        x, att, ffn, S = block.step(x, m.shiftState[i, :, 0], m.shiftState[i, :, 1], m.recState[i])
        recs.append(S)
        shifts.append(torch.stack([att, ffn], dim=1))                                          # [1,2,C]
        if m.rescale_every and (i + 1) % m.rescale_every == 0:
            x = x * 0.5
    m.recState.copy_(torch.stack(recs))
    m.shiftState.copy_(torch.stack(shifts).to(m.shiftState.dtype))
    return x


class Rwkv6Decode(stateful.Decode):
    """One token in, logits out, both states updated once."""

    def __init__(self, g: Geometry, dtype: torch.dtype = torch.float32, rescale_every: int = 0):
        if rescale_every and dtype != torch.float16:
            raise ValueError(f"the fp16 rescale (rescale_every={rescale_every}) applies to fp16 only, not {dtype}: "
                             "elsewhere LayerNorm's eps makes it inexact and the range needs none")
        super().__init__(g, dtype, {"rwkv": Backbone(g), "head": nn.Linear(g.hidden, g.vocab, bias=False)},
                         state_specs(g))
        self.rescale_every = int(rescale_every)
        for block in self.rwkv.blocks:
            for name in WIDE_PARAMS:
                p = getattr(block.attention, name)
                p.data = p.data.to(wide(dtype))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        del position_ids  # RWKV has no positions; kept as an input for engine parity
        x = run_layers(self, self.rwkv.embeddings(input_ids.reshape(1).to(torch.int64)))
        return linear(self.head, self.rwkv.ln_out(x)).reshape(1, 1, self.g.vocab)


class Rwkv6Prefill(stateful.Prefill):
    """``input_ids`` [1,T] (T static) in, logits of the LAST position [1,1,V] out; the decode
    module's own submodules and state buffers (not copies), so parameter names are identical."""

    max_chunk = chunked.MAX_CHUNK

    def __init__(self, decode: Rwkv6Decode, chunk: int):
        super().__init__(decode, chunk)
        self.rescale_every = decode.rescale_every      # the decode module's weights are rescaled or not

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        del position_ids
        x = run_layers(self, self.rwkv.embeddings(input_ids.reshape(self.chunk).to(torch.int64)))
        return linear(self.head, self.rwkv.ln_out(x[-1:])).reshape(1, 1, self.g.vocab)


def build_prefill(decode: Rwkv6Decode, chunk: int = stateful.PREFILL_CHUNK) -> Rwkv6Prefill:
    return Rwkv6Prefill(decode, chunk).eval()


def module_parts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Normal-form tensor -> the decode module's parameter(s): the LoRA matrices become nn.Linear
    weights (transposed; time_maa_w2 split into its five rows); everything else keeps its name."""
    prefix, _, leaf = name.rpartition(".")
    if leaf == "time_maa_w1":
        return [(f"{prefix}.maa_w1.weight", tensor.t())]
    if leaf == "time_maa_w2":
        return [(f"{prefix}.maa_w2.{j}.weight", tensor[j].t()) for j in range(tensor.shape[0])]
    if leaf == "time_decay_w1":
        return [(f"{prefix}.decay_w1.weight", tensor.t())]
    if leaf == "time_decay_w2":
        return [(f"{prefix}.decay_w2.weight", tensor.t())]
    return [(name, tensor)]


def rescaled_parts(rescale_every: int) -> Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]:
    """:func:`module_parts`, with ``attention.output`` and ``feed_forward.value`` of block i divided
    by 2**(i // rescale_every) (exact: a power of two); the others, and block i < rescale_every,
    untouched (the very tensor given)."""
    def parts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if rescale_every and name.endswith(RESCALED):
            shift = int(name.split(".")[2]) // rescale_every      # rwkv.blocks.<i>.
            if shift:
                return [(name, tensor / float(2 ** shift))]
        return module_parts(name, tensor)
    return parts


def build_decode(weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], g: Geometry,
                 dtype: torch.dtype, each_linear: Callable[[str, nn.Linear], nn.Module] | None = None,
                 rescale_every: int | None = None) -> Rwkv6Decode:
    """The decode module with normal-form weights loaded strictly: built on the meta device, each
    weight assigned (:func:`module_parts` of it, cast to the parameter's dtype) as it comes
    (:func:`~recurrent_coreai.coreai.stateful.build_on_meta`; ``each_linear`` replaces a Linear as
    soon as its weight is in).

    ``rescale_every`` (None: :data:`RESCALE_EVERY` in fp16, 0 otherwise; 0: off) is the rwkv
    package's fp16 guard (``RWKV_RESCALE_LAYER``): block i's ``attention.output`` and
    ``feed_forward.value`` weights divided by 2**(i // 6) and x halved after every 6th block, so
    the residual stream of block i is the true one / 2**(i // 6) and ln_out sees the final one /
    2**(L // 6). Every state is a LayerNorm output (shift rows) or made from one (r, k, v, w, g of
    LN1's output): scale-free, so the states stay the reference's; only LayerNorm's eps sees the
    scale (eps * 4**n instead of eps), which is why BlinkDL and this build apply it in fp16 only
    (asked for another dtype it is refused)."""
    if rescale_every is None:
        rescale_every = RESCALE_EVERY if dtype == torch.float16 else 0
    return stateful.build_on_meta(lambda: Rwkv6Decode(g, dtype, rescale_every), weights, each_linear,
                                  parts=rescaled_parts(rescale_every))
