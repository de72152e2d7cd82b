"""The export graph: Mamba-2 as ``nn.Module``s whose two states are mutated buffers.

Decode (:class:`Mamba2Decode`): ``input_ids`` [1,1] int32, ``position_ids`` [1,1] int32 (accepted,
unused), returns ``logits`` [1,1,V]; states ``convState`` [L,1,conv_dim,K] (the last K conv
inputs, newest last: transformers' cache layout) and ``ssmState`` [L,1,H,P,N].

Prefill (:class:`Mamba2Prefill`): ``input_ids`` [1,T] (T static), logits of the LAST position;
built over the decode module's own submodules and buffers (same parameter names: weights stored
once; a quantised decode gives a quantised prefill).

The outer loop (embedding, the blocks, one write per state, final norm and head: :func:`recurrent_coreai.families.ssm.run`),
the norms' and conv's parameter holders and the backbone are families/ssm.py's, shared with the other
Mamba family; the mixer and its :meth:`Block.step` are this family's.

The rules of families/rwkv7/export_graph.py, kept here:
* each layer returns its new state slices; each state gets ONE write per call, at the end
  (``buffer.copy_(torch.stack(...))``);
* every linear goes through :func:`recurrent_coreai.coreai.layers.linear`;
* the recurrence, the decay and its exp, dt's log(1 + e^x), the conv and the norms run in at least fp32
  (:func:`~recurrent_coreai.coreai.layers.wide`), whatever the recipe dtype; the residual stream
  is kept in that wide dtype too (transformers' ``residual_in_fp32``);
* the per-layer math is ONE function (:meth:`Block.step`) over T tokens: only the SSM differs, the
  recurrence for T = 1 and the SSD chunk form (:mod:`.ssd`) for T > 1. The conv is
  :func:`~recurrent_coreai.coreai.layers.short_conv`: the window is the state's last K−1 inputs
  followed by the chunk; the new state is the window's last K rows.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from recurrent_coreai.coreai import stateful
from recurrent_coreai.coreai.layers import linear, short_conv
from recurrent_coreai.families import ssm
from recurrent_coreai.families.mamba2 import ssd
from recurrent_coreai.families.mamba2.geometry import STATE_NAMES  # noqa: F401 - the buffers' names, for tests
from recurrent_coreai.families.mamba2.geometry import Geometry, state_specs
from recurrent_coreai.families.ssm import rms, stable_log1p_exp

# The chunk form's exponents are all <= 0 (see ssd.py), so its length is bounded by the [H,T,T]
# intermediates, not by range; verified exact up to this length (tests/families/test_mamba2_export.py).
MAX_CHUNK = 256


class Mixer(nn.Module):
    def __init__(self, g: Geometry):
        super().__init__()
        self.in_proj = nn.Linear(g.hidden, g.in_proj_width, bias=False)
        self.conv1d = ssm.conv_params(g.conv_dim, g.conv_kernel)
        self.dt_bias = nn.Parameter(torch.zeros(g.heads))
        self.A_log = nn.Parameter(torch.zeros(g.heads))
        self.D = nn.Parameter(torch.zeros(g.heads))
        self.norm = ssm.norm_params(g.intermediate)
        self.out_proj = nn.Linear(g.intermediate, g.hidden, bias=False)


class Block(nn.Module):
    def __init__(self, g: Geometry):
        super().__init__()
        self.g = g
        self.norm = ssm.norm_params(g.hidden)
        self.mixer = Mixer(g)

    def step(self, x: torch.Tensor, conv_prev: torch.Tensor, S: torch.Tensor):
        """T tokens through the layer. x [T,C] (wide dtype, the residual stream); conv_prev
        [conv_dim,K] and S [H,P,N] the state slices before them. Returns x, the new conv slice
        [conv_dim,K] and the new S, both in the states' dtype."""
        g, m = self.g, self.mixer
        T = x.shape[0]
        I, H, P, N, G = g.intermediate, g.heads, g.headdim, g.d_state, g.n_groups
        dtype, wd = S.dtype, x.dtype      # the recipe's dtype (states are held in it) and the wide one
        h = (rms(x, g.norm_eps) * self.norm.weight.to(wd)).to(dtype)
        zxbcdt = linear(m.in_proj, h)                                           # [T, 2I+2GN+H]
        z, xbc, dt = zxbcdt[:, :I], zxbcdt[:, I:I + g.conv_dim], zxbcdt[:, I + g.conv_dim:]
        conv, conv_new = short_conv(conv_prev, xbc, m.conv1d.weight, m.conv1d.bias, wd)  # conv_new: the last K inputs
        xbc = F.silu(conv)
        xs = xbc[:, :I].reshape(T, H, P)
        B = xbc[:, I:I + G * N].reshape(T, G, N).transpose(0, 1)              # [G,T,N]
        C = xbc[:, I + G * N:].reshape(T, G, N).transpose(0, 1)
        dt = stable_log1p_exp(dt.to(wd) + m.dt_bias.to(wd))                     # [T,H]
        A = -torch.exp(m.A_log.to(wd))                                          # [H]
        S0 = S.to(wd)
        if T == 1:
            dA = torch.exp(dt.reshape(H) * A)                                   # [H]
            Bh, Ch = ssd.heads_of_groups(B, H), ssd.heads_of_groups(C, H)        # [H,1,N]
            S_new = S0 * dA.reshape(H, 1, 1) + (dt.reshape(H, 1) * xs.reshape(H, P)).reshape(H, P, 1) * Bh
            y = torch.matmul(S_new, Ch.transpose(-1, -2)).reshape(1, H, P)     # [1,H,P]
        else:
            y, S_new = ssd.ssd_chunk(xs.transpose(0, 1), dt.transpose(0, 1), A, B, C, S0)
            y = y.transpose(0, 1)                                               # [T,H,P]
        y = y + m.D.to(wd).reshape(1, H, 1) * xs
        y = y.reshape(T, I) * F.silu(z.to(wd))
        y = rms(y.reshape(T, G, I // G), g.norm_eps).reshape(T, I) * m.norm.weight.to(wd)
        x = x + linear(m.out_proj, y.to(dtype)).to(wd)
        return x, conv_new.to(conv_prev.dtype), S_new.to(S.dtype)


class Mamba2Decode(stateful.Decode):
    """The decode entry point: one token in, logits out, both states updated once."""

    def __init__(self, g: Geometry, dtype: torch.dtype = torch.float32):
        super().__init__(g, dtype, {"backbone": ssm.backbone(g, Block),
                                    "lm_head": nn.Linear(g.hidden, g.vocab, bias=False)}, state_specs(g))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        del position_ids  # Mamba has no positions; kept as an input for engine parity
        return ssm.run(self, input_ids, 1)


class Mamba2Prefill(stateful.Prefill):
    """The prefill entry point: ``input_ids`` [1,T] (T static) in, the last position's logits out;
    the decode module's own submodules and state buffers (not copies)."""

    max_chunk = MAX_CHUNK

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        del position_ids
        return ssm.run(self, input_ids, self.chunk)


def build_prefill(decode: Mamba2Decode, chunk: int = stateful.PREFILL_CHUNK) -> Mamba2Prefill:
    return Mamba2Prefill(decode, chunk).eval()


def build_decode(weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], g: Geometry,
                 dtype: torch.dtype, each_linear: Callable[[str, nn.Linear], nn.Module] | None = None) -> Mamba2Decode:
    """The decode module with the normal-form weights loaded strictly: built on the meta device,
    each weight assigned (cast to ``dtype``) as it comes
    (:func:`~recurrent_coreai.coreai.stateful.build_on_meta`; ``each_linear`` replaces a Linear as
    soon as its weight is in)."""
    return stateful.build_on_meta(lambda: Mamba2Decode(g, dtype), weights, each_linear)
