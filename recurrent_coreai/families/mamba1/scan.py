"""The exact chunk form of Mamba-1's selective scan, from standard ops only.

Per channel i and state n, token t (the decay is per (i, n): A is a matrix, so Mamba-2's scalar
per-head form does not apply), with a_t = Δ_t[i]·A[i, n] ≤ 0 (A = −exp(A_log)):

    S_t = e^{a_t} S_{t−1} + Δ_t u_t B_t            y_t = S_t C_t
    ⇒ S_t = e^{c_t} S_0 + Σ_{s≤t} e^{c_t − c_s} Δ_s u_s B_s           c_t = Σ_{r≤t} a_r

The chunk is cut into blocks of :data:`BLOCK` tokens. Inside a block every state is formed at once
from the segment sums c_t − c_s (s ≤ t), taken as masked cumulative sums Σ_{s<r≤t} a_r (no
difference of two large sums), so every exponent is ≤ 0 and nothing can overflow; the blocks run
one after another, each starting from the state the last one left. A block holds [b, b, I, N]
values (b = BLOCK): 8 x 8 x 8192 x 16 fp32 is 33 MB at Falcon Mamba 7B's width. Runs in fp32 at
least (fp64 in an fp64 graph).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

BLOCK = 8   # tokens per block: the state-sized intermediates grow with BLOCK², the sequential steps with T/BLOCK


@lru_cache(maxsize=None)
def _mask_data(b: int) -> tuple[np.ndarray, np.ndarray]:
    t, s = np.arange(b).reshape(b, 1), np.arange(b).reshape(1, b)
    return (t > s).astype(np.float64), (t >= s).astype(np.float64)


def _masks(b: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, b, 1, 1] masks, fresh tensors per call (graph constants: a tensor made in one
    torch.export trace must not leak into the next one, so only the numpy data is cached)."""
    strict, incl = (torch.tensor(m, dtype=dtype).reshape(b, b, 1, 1) for m in _mask_data(b))
    return strict, incl


def scan_block(a: torch.Tensor, bu: torch.Tensor, C: torch.Tensor, S0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """b tokens at once: ``a`` [b,I,N] the log-decays Δ·A (≤ 0), ``bu`` [b,I,N] the inputs Δ·u·Bᵀ,
    ``C`` [b,N], ``S0`` [I,N]. Returns y [b,I] (C·S_t, no D skip) and S_b [I,N]."""
    b = a.shape[0]
    if b == 1:
        S = torch.exp(a[0]) * S0 + bu[0]
        return torch.matmul(S, C.reshape(-1, 1)).reshape(1, -1), S
    strict, incl = _masks(b, a.dtype)
    seg = torch.cumsum(a.unsqueeze(1) * strict, dim=0)          # [t,s,I,N] = Σ_{s<r≤t} a_r (t ≥ s), else 0
    L = torch.exp(seg) * incl                                  # e^{c_t − c_s}, causal
    c = torch.cumsum(a, dim=0)                                 # [b,I,N] inclusive, ≤ 0
    S = torch.exp(c) * S0 + (L * bu.unsqueeze(0)).sum(1)       # [b,I,N]: every state of the block
    y = (S * C.unsqueeze(1)).sum(-1)                           # [b,I]
    return y, S[b - 1]


def selective_scan(dt: torch.Tensor, A: torch.Tensor, u: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   S0: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens: ``dt`` [T,I] (after log(1 + e^x)), ``A`` [I,N] (negative), ``u`` [T,I], ``B`` and ``C``
    [T,N], ``S0`` [I,N]. Returns y [T,I] (no D skip) and S_T [I,N], in the dtype of the inputs."""
    T = dt.shape[0]
    a = dt.unsqueeze(-1) * A                                   # [T,I,N], ≤ 0
    bu = (dt * u).unsqueeze(-1) * B.unsqueeze(1)               # [T,I,N]
    ys, S = [], S0
    for at in range(0, T, block):
        y, S = scan_block(a[at:at + block], bu[at:at + block], C[at:at + block], S)
        ys.append(y)
    return (ys[0] if len(ys) == 1 else torch.cat(ys, dim=0)), S
