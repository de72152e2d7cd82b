"""Graph pieces every family's export modules share: how a linear is written so that Core AI's
Linux runtime sums it in fp32, the widened dtype for decays and norms, and the token shift.

Nothing here knows an architecture: a family's modules (``families/<name>/``) import these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def linear(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``mod(x)`` for ``x`` [T, in]: every linear of the graph goes through here, over the module's
    own ``weight``/``bias`` (a coreai-opt quantised linear's ``weight`` is its dequantisation).

    Not written as ``F.linear`` because of what Core AI's Linux runtime does with that form
    (measured; docs/measurements/2026-11-30-fp16-accumulation.md): it sums an fp16 ``batch_matmul`` in fp16, one
    product at a time -- at the 1.5B widths 20-55x the error of a once-rounded product, enough to
    flip top-1 tokens -- and it transposes the constant weight on every call. So:
    * fp16 (and a dequantised int8 weight): a 1x1 convolution over the weight as stored. The
      runtime sums a convolution in fp32: one 8192x2048 linear, process CPU and |error| against
      eager torch (bench/bench_linear.py --linears): T=1 743 ms / 0.027 -> 165 ms / 0.0005 (one
      fp16 rounding), T=64 42.8 s -> 0.34 s. Casting W to fp32 in the graph is about as fast
      here, but makes the converter fold the small weights (the LoRA factors) to fp32 (+1.6% to
      +2.3% bundle at 1.5B) and would triple a device's weight traffic;
    * fp32/fp64: ``(W xᵀ)ᵀ``, the weight used as stored (T=1 140 -> 71 ms).
    """
    w = mod.weight  # read once: a quantised linear's weight is a graph op (its dequantisation)
    if w.dtype == torch.float16:
        return F.conv1d(x.transpose(0, 1).unsqueeze(0), w.unsqueeze(-1), mod.bias)[0].transpose(0, 1)
    y = torch.matmul(w, x.transpose(0, 1)).transpose(0, 1)
    return y if mod.bias is None else y + mod.bias


def wide(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 (fp16 -> fp32; an fp64 graph stays fp64): for the decay and the kk norm."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def token_shift(prev: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Each token's previous row: ``prev`` [1,C] for the first token, then h[:-1] ([T,C] in all)."""
    return prev if h.shape[0] == 1 else torch.cat([prev, h[:-1]], dim=0)


def last_row(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[0] == 1 else t[-1:]


def short_conv(prev: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A short causal depthwise convolution over T tokens, before its activation (Mamba-2's conv1d,
    Gated DeltaNet's q/k/v convs).

    ``prev`` [D,K]: the window before these tokens (the last K inputs, newest last: transformers' and
    fla's cache layout); ``x`` [T,D] the new inputs; ``weight`` [D,1,K] (nn.Conv1d's depthwise
    layout, tap K-1 on the newest input); ``bias`` [D] or None. Computed in ``dtype`` as a sum of K
    shifted products (no conv op: the same graph for T = 1 and a chunk). Returns the pre-activation
    output [T,D] and the new window [D,K] (the last K inputs), both in ``dtype``."""
    T, K = x.shape[0], weight.shape[-1]
    seq = torch.cat([prev[:, 1:].transpose(0, 1).to(dtype), x.to(dtype)], dim=0)   # [K-1+T, D]
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    out = seq[0:T] * w[:, 0, 0]
    if b is not None:
        out = b + out
    for k in range(1, K):
        out = out + seq[k:k + T] * w[:, 0, k]
    return out, seq[T - 1:].transpose(0, 1)
