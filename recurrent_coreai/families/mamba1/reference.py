"""The Mamba-1 oracle: one token at a time, fp32 or fp64, written from the equations.

Per layer, token x (residual stream, kept in the reference dtype -- HF keeps it in fp32):

    h = RMSNorm(x) * norm.weight                         (eps = norm_eps)
    u | z = in_proj h                                    (I | I)
    conv window = the last K inputs u, newest last      (convState [I, K])
    u = silu(Σ_k window[:, k] * conv1d.weight[:, 0, k] + conv1d.bias)
    δ | B | C = x_proj u                                 (R | N | N)
    Falcon Mamba only: δ, B, C each RMS-normalised, no weight (eps = mixer_eps)
    Δ = softplus(dt_proj.weight δ + dt_proj.bias)        ([I])
    A = -exp(A_log)                                      ([I, N])
    S = exp(Δ A) ⊙ S + (Δ u) Bᵀ                          (ssmState [I, N])
    y = S C + D ⊙ u
    x = x + out_proj (y ⊙ silu(z))
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
        return {"conv": torch.zeros(g.layers, g.intermediate, g.conv_kernel, dtype=self.dtype),
                "ssm": torch.zeros(g.layers, g.intermediate, g.d_state, dtype=self.dtype)}

    def layer(self, i: int, x: torch.Tensor, state: dict) -> torch.Tensor:
        g, w = self.g, self.w
        p = f"backbone.layers.{i}.mixer."
        I, N, R = g.intermediate, g.d_state, g.dt_rank
        h = rms_norm(x, w[f"backbone.layers.{i}.norm.weight"], g.norm_eps)
        uz = w[p + "in_proj.weight"] @ h
        u, z = uz[:I], uz[I:]
        window = torch.cat([state["conv"][i, :, 1:], u[:, None]], dim=1)       # [I, K], newest last
        state["conv"][i] = window
        u = F.silu((window * w[p + "conv1d.weight"][:, 0, :]).sum(-1) + w[p + "conv1d.bias"])
        dbc = w[p + "x_proj.weight"] @ u
        d, B, C = dbc[:R], dbc[R:R + N], dbc[R + N:]
        if g.falcon:
            d, B, C = (rms_norm(t, 1.0, g.mixer_eps) for t in (d, B, C))
        dt = F.softplus(w[p + "dt_proj.weight"] @ d + w[p + "dt_proj.bias"])    # [I]
        A = -torch.exp(w[p + "A_log"])                                          # [I, N]
        S = state["ssm"][i] * torch.exp(dt[:, None] * A) + (dt * u)[:, None] * B[None, :]
        state["ssm"][i] = S
        y = S @ C + w[p + "D"] * u
        return x + w[p + "out_proj.weight"] @ (y * F.silu(z))
