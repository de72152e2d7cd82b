"""The Mamba-2 oracle: one token at a time, fp32 or fp64, written from the equations.

Per layer, token x (residual stream, kept in the reference dtype — HF keeps it in fp32):

    h = RMSNorm(x) * norm.weight
    z | xBC | dt_in = in_proj h                         (I | I + 2GN | H)
    conv window = the last K xBC inputs, newest last    (convState [conv_dim, K])
    xBC = silu(Σ_k window[:, k] * conv1d.weight[:, 0, k] + conv1d.bias)
    x | B | C = xBC                                     (I = H*P | G*N | G*N); head h reads group h // (H/G)
    dt = softplus(dt_in + dt_bias);  A = -exp(A_log);  dA = exp(dt * A)
    S_h = dA_h S_h + dt_h x_h B_hᵀ                        (ssmState [H, P, N])
    y_h = S_h C_h + D_h x_h                             (D skip added before the gate)
    y = RMSNorm_per_group(y * silu(z)) * mixer.norm.weight   (groups of I/G, eps = norm_eps)
    x = x + out_proj y
    logits = lm_head(RMSNorm(x) * norm_f.weight)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recurrent_coreai.families import ssm
from recurrent_coreai.families.ssm import rms_norm


class Reference(ssm.Reference):
    """Over the normal-form weights as given (the checkpoint reader checked them); the outer loop
    (embedding, layers, head) and the bundle's state layout are families/ssm.py's."""

    def zero_state(self) -> dict[str, torch.Tensor]:
        g = self.g
        return {"conv": torch.zeros(g.layers, g.conv_dim, g.conv_kernel, dtype=self.dtype),
                "ssm": torch.zeros(g.layers, g.heads, g.headdim, g.d_state, dtype=self.dtype)}

    def layer(self, i: int, x: torch.Tensor, state: dict) -> torch.Tensor:
        g, w = self.g, self.w
        p = f"backbone.layers.{i}."
        I, H, P, N, G = g.intermediate, g.heads, g.headdim, g.d_state, g.n_groups
        h = rms_norm(x, w[p + "norm.weight"], g.norm_eps)
        zxbcdt = w[p + "mixer.in_proj.weight"] @ h
        z, xbc, dt = zxbcdt[:I], zxbcdt[I:I + g.conv_dim], zxbcdt[I + g.conv_dim:]
        window = torch.cat([state["conv"][i, :, 1:], xbc[:, None]], dim=1)     # [conv_dim, K], newest last
        state["conv"][i] = window
        xbc = F.silu((window * w[p + "mixer.conv1d.weight"][:, 0, :]).sum(-1) + w[p + "mixer.conv1d.bias"])
        xs = xbc[:I].reshape(H, P)
        B = xbc[I:I + G * N].reshape(G, N).repeat_interleave(H // G, dim=0)      # [H, N]
        C = xbc[I + G * N:].reshape(G, N).repeat_interleave(H // G, dim=0)
        dt = F.softplus(dt + w[p + "mixer.dt_bias"])                             # [H]
        A = -torch.exp(w[p + "mixer.A_log"])
        dA = torch.exp(dt * A)
        S = state["ssm"][i] * dA[:, None, None] + (dt[:, None] * xs)[:, :, None] * B[:, None, :]
        state["ssm"][i] = S
        y = (S * C[:, None, :]).sum(-1) + w[p + "mixer.D"][:, None] * xs            # [H, P]
        y = y.reshape(I) * F.silu(z)
        y = rms_norm(y.reshape(G, I // G), 1.0, g.norm_eps).reshape(I) * w[p + "mixer.norm.weight"]
        return x + w[p + "mixer.out_proj.weight"] @ y
