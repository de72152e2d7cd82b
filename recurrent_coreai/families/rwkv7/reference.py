"""The oracle: a plain, token-by-token PyTorch transcription of RWKV-7 (x070).

Deliberately separate from the export graph (``export_graph.py``): no fused state writes,
no dtype tricks, fla's [H, K, V] state orientation, fp32 or fp64 throughout. It accepts
split (``attn.x_r`` …) and packed (``attn.x_x``) mixers through ``layouts.normalize``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

import numpy as np

from recurrent_coreai.families import base
from recurrent_coreai.families.rwkv7.geometry import MIXERS, Geometry
from recurrent_coreai.families.rwkv7.layouts import normalize


@dataclass
class State:
    att_shift: torch.Tensor  # [L, C]   previous token's attn_norm output per layer
    ffn_shift: torch.Tensor  # [L, C]   previous token's ffn_norm output per layer
    wkv: torch.Tensor        # [L, H, K, V]


class Reference(base.Reference):
    def normal_weights(self, weights: Mapping[str, torch.Tensor], geom: Geometry) -> dict[str, torch.Tensor]:
        return normalize(weights, geom, "reference weights")

    def zero_state(self) -> State:
        g = self.g
        return State(torch.zeros(g.layers, g.hidden, dtype=self.dtype),
                     torch.zeros(g.layers, g.hidden, dtype=self.dtype),
                     torch.zeros(g.layers, g.heads, g.head_dim, g.head_dim, dtype=self.dtype))

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (self.g.hidden,), self.w[name + ".weight"], self.w[name + ".bias"], self.g.norm_eps)

    def _lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.w[name + ".weight"] @ x

    @torch.no_grad()
    def advance(self, token: int, state: State) -> torch.Tensor:
        """The residual stream after every layer for one token; ``state`` is updated in place."""
        g, w = self.g, self.w
        H, N = g.heads, g.head_dim
        x = w["model.embeddings.weight"][token]
        v_first = None
        for i in range(g.layers):
            p = f"model.layers.{i}."
            if i == 0:
                x = self._ln(x, p + "pre_norm")
            # --- time mix ---
            h = self._ln(x, p + "attn_norm")
            d = state.att_shift[i] - h
            state.att_shift[i] = h
            xr, xw, xk, xv, xa, xg = (h + d * w[f"{p}attn.x_{m}"].reshape(-1) for m in MIXERS)
            r = self._lin(p + "attn.r_proj", xr)
            k = self._lin(p + "attn.k_proj", xk)
            v = self._lin(p + "attn.v_proj", xv)
            lw = p + "attn.w_lora.lora."
            logw = -torch.exp(torch.tensor(-0.5, dtype=self.dtype)) * torch.sigmoid(
                w[lw + "2.weight"] @ torch.tanh(w[lw + "0.weight"] @ xw) + w[lw + "2.bias"])
            if i == 0:
                v_first = v
            else:
                lv = p + "attn.v_lora.lora."
                v = v + (v_first - v) * torch.sigmoid(w[lv + "2.weight"] @ (w[lv + "0.weight"] @ xv) + w[lv + "2.bias"])
            la = p + "attn.a_lora.lora."
            a = torch.sigmoid(w[la + "2.weight"] @ (w[la + "0.weight"] @ xa) + w[la + "2.bias"])
            lg = p + "attn.g_lora.lora."
            gate = w[lg + "2.weight"] @ torch.sigmoid(w[lg + "0.weight"] @ xg)
            kk = (k * w[p + "attn.k_k"]).reshape(H, N)
            kk = kk / kk.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            k = k * (1 + (a - 1) * w[p + "attn.k_a"])
            rh, kh, vh, ah = r.reshape(H, N), k.reshape(H, N), v.reshape(H, N), a.reshape(H, N)
            decay = torch.exp(logw).reshape(H, N)
            new_heads = []
            outs = []
            for hd in range(H):
                S = state.wkv[i, hd]                                  # [K, V]
                kka = kk[hd] * ah[hd]
                S_new = decay[hd][:, None] * S - torch.outer(kka, kk[hd] @ S) + torch.outer(kh[hd], vh[hd])
                new_heads.append(S_new)
                outs.append(S_new.T @ rh[hd])
            state.wkv[i] = torch.stack(new_heads)
            o = torch.cat(outs)
            o = F.group_norm(o[None], H, w[p + "attn.g_norm.weight"], w[p + "attn.g_norm.bias"],
                             eps=g.g_norm_eps)[0]
            bonus = (rh * kh * w[p + "attn.r_k"]).sum(-1, keepdim=True) * vh
            o = o + bonus.reshape(-1)
            x = x + self._lin(p + "attn.o_proj", o * gate)
            # --- channel mix ---
            h = self._ln(x, p + "ffn_norm")
            d = state.ffn_shift[i] - h
            state.ffn_shift[i] = h
            kx = h + d * w[p + "ffn.x_k"]
            x = x + self._lin(p + "ffn.value", torch.relu(self._lin(p + "ffn.key", kx)) ** 2)
        return x

    @torch.no_grad()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.w["lm_head.weight"] @ self._ln(x, "model.norm")

    def bundle_states(self, state: State) -> dict[str, np.ndarray]:
        """The state in the bundle's layout: recState [L,1,H,K,V], shiftState [L,1,2,C] (float32)."""
        arrays = {"recState": state.wkv[:, None],
                  "shiftState": torch.stack([state.att_shift, state.ffn_shift], 1)[:, None]}
        return {name: arrays[name].numpy().astype(np.float32) for name in ("recState", "shiftState")}
