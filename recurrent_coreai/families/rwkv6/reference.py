"""The oracle: a plain, token-by-token transcription of RWKV-6 (x060) in fp32 or fp64.

Deliberately separate from the export modules: no fused state writes, no chunking, no dtype
tricks; the math as BlinkDL's x060 RNN mode writes it (rwkv 0.8.32 ``att_one_v6_0`` /
``ffn_one_v6``), over normal-form (HF) names:

* ``blocks.0.ln0`` (``pre_ln``) applied to the embedding, then per layer LN1 -> time mix, LN2 ->
  channel mix, each with a token shift whose previous row is the state;
* ddlerp: xxx = x + (x_prev - x)*maa_x; (mw,mk,mv,mr,mg) = tanh(xxx W1) W2 (five LoRAs, D_MIX);
  x_m = x + (x_prev - x)*(maa_m + m_m);
* decay w = exp(-exp(time_decay + tanh(x_w Wd1) Wd2)) (D_DECAY);
* per head, state S [K,V]: out = r·(u⊙k vᵀ + S), then S = k vᵀ + w⊙S (u = time_faaaa);
* ln_x: GroupNorm over heads with eps = 1e-5 * head_size_divisor**2 (64e-5 at the official divisor 8,
  whatever the head size: geometry.ln_x_eps); out * silu(gate) -> output;
* channel mix: sigmoid(receptance x_r) * value(relu(key x_k)²).

The three pieces a broken copy may replace (tests do, to show the official comparison catches
each) are methods: :meth:`decay`, :meth:`wkv_head`, :attr:`ln_x_eps`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from recurrent_coreai.families import base
from recurrent_coreai.families.rwkv6.geometry import MAA, MIX, Geometry
from recurrent_coreai.families.rwkv6.layouts import normalize


@dataclass
class State:
    att_shift: torch.Tensor  # [L, C]   previous token's LN1 output per layer
    ffn_shift: torch.Tensor  # [L, C]   previous token's LN2 output per layer
    wkv: torch.Tensor        # [L, H, K, V]


class Reference(base.Reference):
    def normal_weights(self, weights: Mapping[str, torch.Tensor], geom: Geometry) -> dict[str, torch.Tensor]:
        return normalize(weights, geom, "reference weights")

    @property
    def ln_x_eps(self) -> float:
        return self.g.ln_x_eps

    def zero_state(self) -> State:
        g = self.g
        return State(torch.zeros(g.layers, g.hidden, dtype=self.dtype),
                     torch.zeros(g.layers, g.hidden, dtype=self.dtype),
                     torch.zeros(g.layers, g.heads, g.head_dim, g.head_dim, dtype=self.dtype))

    def bundle_states(self, state: State) -> dict[str, np.ndarray]:
        g = self.g
        rec = state.wkv.reshape(g.layers, 1, g.heads, g.head_dim, g.head_dim)
        shift = torch.stack([state.att_shift, state.ffn_shift], dim=1).reshape(g.layers, 1, 2, g.hidden)
        return {"recState": rec.to(torch.float32).numpy().copy(), "shiftState": shift.to(torch.float32).numpy().copy()}

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (self.g.hidden,), self.w[name + ".weight"], self.w[name + ".bias"], self.g.norm_eps)

    def decay(self, d: torch.Tensor) -> torch.Tensor:
        """w from the decay logit d = time_decay + LoRA (at least fp32)."""
        return torch.exp(-torch.exp(d))

    def wkv_head(self, r, k, v, w, u, S):
        """One head, one token: (out [V], new S [K,V]); S is read before the decay."""
        kv = torch.outer(k, v)
        out = r @ (u[:, None] * kv + S)
        return out, kv + w[:, None] * S

    @torch.no_grad()
    def advance(self, token: int, state: State) -> torch.Tensor:
        g, w = self.g, self.w
        H, N = g.heads, g.head_dim
        x = w["rwkv.embeddings.weight"][token]
        for i in range(g.layers):
            p = f"rwkv.blocks.{i}."
            a = p + "attention."
            if i == 0:
                x = self._ln(x, p + "pre_ln")
            # --- time mix ---
            h = self._ln(x, p + "ln1")
            sx = state.att_shift[i] - h
            state.att_shift[i] = h
            xxx = h + sx * w[a + "time_maa_x"].reshape(-1)
            lora = torch.tanh(xxx @ w[a + "time_maa_w1"]).reshape(len(MIX), g.mix_lora)
            mix = torch.einsum("fd,fdc->fc", lora, w[a + "time_maa_w2"])          # [5, C]
            xm = {m: h + sx * (w[f"{a}time_maa_{m}"].reshape(-1) + mix[j]) for j, m in enumerate(MIX)}
            r = w[a + "receptance.weight"] @ xm["r"]
            k = w[a + "key.weight"] @ xm["k"]
            v = w[a + "value.weight"] @ xm["v"]
            gate = F.silu(w[a + "gate.weight"] @ xm["g"])
            d = w[a + "time_decay"].reshape(-1) + torch.tanh(xm["w"] @ w[a + "time_decay_w1"]) @ w[a + "time_decay_w2"]
            decay = self.decay(d.to(torch.promote_types(d.dtype, torch.float32))).to(self.dtype).reshape(H, N)
            u = w[a + "time_faaaa"].reshape(H, N)
            rh, kh, vh = r.reshape(H, N), k.reshape(H, N), v.reshape(H, N)
            outs, states = [], []
            for hd in range(H):
                o, S = self.wkv_head(rh[hd], kh[hd], vh[hd], decay[hd], u[hd], state.wkv[i, hd])
                outs.append(o)
                states.append(S)
            state.wkv[i] = torch.stack(states)
            o = F.group_norm(torch.cat(outs)[None], H, w[a + "ln_x.weight"], w[a + "ln_x.bias"], eps=self.ln_x_eps)[0]
            x = x + w[a + "output.weight"] @ (o * gate)
            # --- channel mix ---
            f = p + "feed_forward."
            h2 = self._ln(x, p + "ln2")
            sx = state.ffn_shift[i] - h2
            state.ffn_shift[i] = h2
            xk = h2 + sx * w[f + "time_maa_k"].reshape(-1)
            xr = h2 + sx * w[f + "time_maa_r"].reshape(-1)
            kk = torch.relu(w[f + "key.weight"] @ xk) ** 2
            x = x + torch.sigmoid(w[f + "receptance.weight"] @ xr) * (w[f + "value.weight"] @ kk)
        return x

    @torch.no_grad()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.w["head.weight"] @ self._ln(x, "rwkv.ln_out")


assert MAA[0] == "x"  # time_maa_x is the one mixer without a LoRA
