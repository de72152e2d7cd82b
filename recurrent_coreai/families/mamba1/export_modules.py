"""The export graph: Mamba-1 as ``nn.Module``s whose two states are mutated buffers.

Decode (:class:`Mamba1Decode`): ``input_ids`` [1,1] int32, ``position_ids`` [1,1] int32 (accepted,
unused), returns ``logits`` [1,1,V]; states ``convState`` [L,1,I,K] (the last K conv inputs,
newest last: transformers' cache layout) and ``ssmState`` [L,1,I,N].

Prefill (:class:`Mamba1Prefill`): ``input_ids`` [1,T] (T static), logits of the LAST position;
built over the decode module's own submodules and buffers (same parameter names: weights stored
once; a quantised decode gives a quantised prefill).

The outer loop (embedding, the blocks, one write per state, final norm and head: :func:`recurrent_coreai.families.ssm.run`),
the norms' and conv's parameter holders and the backbone are families/ssm.py's, shared with the other
Mamba family; the mixer and its :meth:`Block.step` are this family's.

The rules of families/rwkv7/export_graph.py, kept here:
* each layer returns its new state slices; each state gets ONE write per call, at the end
  (``buffer.copy_(torch.stack(...))``);
* every linear goes through :func:`recurrent_coreai.coreai.layers.linear`;
* the recurrence, the decay and its exp, Δ's log(1 + e^x), the conv and the norms (Falcon Mamba's
  weight-free ones on δ, B and C included) run in at least fp32
  (:func:`~recurrent_coreai.coreai.layers.wide`), whatever the recipe dtype; the residual stream is
  kept in that wide dtype too (transformers' ``residual_in_fp32``);
* the per-layer math is ONE function (:meth:`Block.step`) over T tokens; the selective scan is
  :func:`.scan.selective_scan` (the recurrence itself for T = 1, the exact chunk form in levels of
  blocks beyond). The conv is :func:`~recurrent_coreai.coreai.layers.short_conv`: the window is the
  state's last K−1 inputs followed by the chunk; the new state is the window's last K rows.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from recurrent_coreai.coreai import stateful
from recurrent_coreai.coreai.layers import linear, short_conv
from recurrent_coreai.families import ssm
from recurrent_coreai.families.mamba1 import scan
from recurrent_coreai.families.mamba1.geometry import STATE_NAMES  # noqa: F401 - the buffers' names, for tests
from recurrent_coreai.families.mamba1.geometry import Geometry, state_specs
from recurrent_coreai.families.ssm import rms, stable_log1p_exp

# The chunk form's exponents are all <= 0 (scan.py) and its largest intermediate holds T·2·I·N
# values, so the chunk length is bounded only by memory; verified exact up to this length
# (tests/families/test_mamba1_export.py).
MAX_CHUNK = 256


class Mixer(nn.Module):
    def __init__(self, g: Geometry):
        super().__init__()
        self.in_proj = nn.Linear(g.hidden, 2 * g.intermediate, bias=False)
        self.conv1d = ssm.conv_params(g.intermediate, g.conv_kernel)
        self.x_proj = nn.Linear(g.intermediate, g.x_proj_width, bias=False)
        self.dt_proj = nn.Linear(g.dt_rank, g.intermediate, bias=True)
        self.A_log = nn.Parameter(torch.zeros(g.intermediate, g.d_state))
        self.D = nn.Parameter(torch.zeros(g.intermediate))
        self.out_proj = nn.Linear(g.intermediate, g.hidden, bias=False)


class Block(nn.Module):
    def __init__(self, g: Geometry):
        super().__init__()
        self.g = g
        self.norm = ssm.norm_params(g.hidden)
        self.mixer = Mixer(g)

    def step(self, x: torch.Tensor, conv_prev: torch.Tensor, S: torch.Tensor):
        """T tokens through the layer. x [T,C] (wide dtype, the residual stream); conv_prev [I,K]
        and S [I,N] the state slices before them. Returns x, the new conv slice [I,K] and the new
        S, both in the states' dtype."""
        g, m = self.g, self.mixer
        I, N, R = g.intermediate, g.d_state, g.dt_rank
        dtype, wd = S.dtype, x.dtype      # the recipe's dtype (states are held in it) and the wide one
        h = (rms(x, g.norm_eps) * self.norm.weight.to(wd)).to(dtype)
        uz = linear(m.in_proj, h)                                               # [T, 2I]
        u, z = uz[:, :I], uz[:, I:]
        conv, conv_new = short_conv(conv_prev, u, m.conv1d.weight, m.conv1d.bias, wd)  # conv_new: the last K inputs
        u = F.silu(conv)                                                        # [T,I] wide
        dbc = linear(m.x_proj, u.to(dtype)).to(wd)                              # [T, R+2N]
        d, B, C = dbc[:, :R], dbc[:, R:R + N], dbc[:, R + N:]
        if g.falcon:
            d, B, C = rms(d, g.mixer_eps), rms(B, g.mixer_eps), rms(C, g.mixer_eps)
        dt = stable_log1p_exp(linear(m.dt_proj, d.to(dtype)).to(wd))             # [T,I]
        A = -torch.exp(m.A_log.to(wd))                                          # [I,N]
        y, S_new = scan.selective_scan(dt, A, u, B, C, S.to(wd))
        y = (y + m.D.to(wd) * u) * F.silu(z.to(wd))
        x = x + linear(m.out_proj, y.to(dtype)).to(wd)
        return x, conv_new.to(conv_prev.dtype), S_new.to(S.dtype)


class Mamba1Decode(stateful.Decode):
    """The decode entry point: one token in, logits out, both states updated once."""

    def __init__(self, g: Geometry, dtype: torch.dtype = torch.float32):
        super().__init__(g, dtype, {"backbone": ssm.backbone(g, Block),
                                    "lm_head": nn.Linear(g.hidden, g.vocab, bias=False)}, state_specs(g))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        del position_ids  # Mamba has no positions; kept as an input for engine parity
        return ssm.run(self, input_ids, 1)


class Mamba1Prefill(stateful.Prefill):
    """The prefill entry point: ``input_ids`` [1,T] (T static) in, the last position's logits out;
    the decode module's own submodules and state buffers (not copies)."""

    max_chunk = MAX_CHUNK

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        del position_ids
        return ssm.run(self, input_ids, self.chunk)


def build_prefill(decode: Mamba1Decode, chunk: int = stateful.PREFILL_CHUNK) -> Mamba1Prefill:
    return Mamba1Prefill(decode, chunk).eval()


def build_decode(weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], g: Geometry,
                 dtype: torch.dtype, each_linear: Callable[[str, nn.Linear], nn.Module] | None = None) -> Mamba1Decode:
    """The decode module with the normal-form weights loaded strictly: built on the meta device,
    each weight assigned (cast to ``dtype``) as it comes
    (:func:`~recurrent_coreai.coreai.stateful.build_on_meta`; ``each_linear`` replaces a Linear as
    soon as its weight is in)."""
    return stateful.build_on_meta(lambda: Mamba1Decode(g, dtype), weights, each_linear)
