"""The Gated DeltaNet oracle: one token at a time, fp32 or fp64, written from the equations
(fla's ``GatedDeltaNetForCausalLM`` with its ``fused_recurrent`` step).

Per layer, residual stream x:

    h = RMSNorm(x) * attn_norm.weight
    q = silu(conv_q(q_proj h)), k = silu(conv_k(k_proj h)), v = silu(conv_v(v_proj h))   (short causal convs, no bias)
    q, k: per head [H,K], L2-normalised; q scaled by 1/sqrt(K); GVA: v head i reads q/k head i // (Hv/H)
    g = -exp(A_log) softplus(a_proj h + dt_bias);  beta = sigmoid(b_proj h) (x2 with allow_neg_eigval)
    o = the gated delta rule (recurrence.delta_step) over S [Hv,K,V]
    o = RMSNorm_per_head(o) * o_norm.weight * silu(g_proj h)   (use_gate; else without the silu factor)
    x = x + o_proj o
    x = x + down_proj(silu(gate_proj m) * up_proj m),   m = RMSNorm(x) * mlp_norm.weight
    logits = lm_head(RMSNorm(x) * norm.weight)
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from recurrent_coreai.families import base
from recurrent_coreai.families.gdn import recurrence as rec


def rms_norm(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Reference(base.Reference):
    """Over the normal-form weights as given (the checkpoint reader checked them)."""

    def zero_state(self) -> dict[str, torch.Tensor]:
        g = self.g
        z = lambda *s: torch.zeros(*s, dtype=self.dtype)  # noqa: E731
        return {"conv_q": z(g.layers, g.key_dim, g.conv_size), "conv_k": z(g.layers, g.key_dim, g.conv_size),
                "conv_v": z(g.layers, g.value_dim, g.conv_size),
                "S": z(g.layers, g.hv, g.head_dim, g.head_v_dim)}

    def mixer(self, i: int, h: torch.Tensor, state: dict) -> torch.Tensor:
        g, w = self.g, self.w
        p = f"model.layers.{i}.attn."
        H, Hv, K, V = g.heads, g.hv, g.head_dim, g.head_v_dim
        q, state["conv_q"][i] = rec.conv_silu(state["conv_q"][i], w[p + "q_proj.weight"] @ h, w[p + "q_conv1d.weight"])
        k, state["conv_k"][i] = rec.conv_silu(state["conv_k"][i], w[p + "k_proj.weight"] @ h, w[p + "k_conv1d.weight"])
        v, state["conv_v"][i] = rec.conv_silu(state["conv_v"][i], w[p + "v_proj.weight"] @ h, w[p + "v_conv1d.weight"])
        q = rec.heads_of(rec.l2norm(q.reshape(H, K)), Hv, 0) * (1.0 / math.sqrt(K))
        k = rec.heads_of(rec.l2norm(k.reshape(H, K)), Hv, 0)
        decay = rec.gate(w[p + "a_proj.weight"] @ h, w[p + "A_log"], w[p + "dt_bias"])
        strength = rec.beta(w[p + "b_proj.weight"] @ h, g.allow_neg_eigval)
        o, state["S"][i] = rec.delta_step(state["S"][i], q, k, v.reshape(Hv, V), decay, strength)
        o = rms_norm(o, w[p + "o_norm.weight"], g.norm_eps)
        if g.use_gate:
            o = o * F.silu((w[p + "g_proj.weight"] @ h).reshape(Hv, V))
        return w[p + "o_proj.weight"] @ o.reshape(Hv * V)

    def layer(self, i: int, x: torch.Tensor, state: dict) -> torch.Tensor:
        g, w = self.g, self.w
        p = f"model.layers.{i}."
        x = x + self.mixer(i, rms_norm(x, w[p + "attn_norm.weight"], g.norm_eps), state)
        m = rms_norm(x, w[p + "mlp_norm.weight"], g.norm_eps)
        return x + w[p + "mlp.down_proj.weight"] @ (F.silu(w[p + "mlp.gate_proj.weight"] @ m)
                                                   * (w[p + "mlp.up_proj.weight"] @ m))

    def advance(self, token: int, state: dict) -> torch.Tensor:
        x = self.w["model.embeddings.weight"][int(token)]
        for i in range(self.g.layers):
            x = self.layer(i, x, state)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.w["lm_head.weight"] @ rms_norm(x, self.w["model.norm.weight"], self.g.norm_eps)

    def bundle_states(self, state: dict) -> dict[str, np.ndarray]:
        return {"convQState": state["conv_q"].unsqueeze(1).float().numpy().copy(),
                "convKState": state["conv_k"].unsqueeze(1).float().numpy().copy(),
                "convVState": state["conv_v"].unsqueeze(1).float().numpy().copy(),
                "recurrentState": state["S"].unsqueeze(1).float().numpy().copy()}
