"""The exact chunk form of Mamba-1's selective scan, from standard ops only (no loop over tokens).

Per channel i and state n, token t (the decay is per (i, n): A is a matrix, so Mamba-2's scalar
per-head form does not apply), with a_t = Δ_t[i]·A[i, n] ≤ 0 (A = −exp(A_log)):

    S_t = e^{a_t} S_{t−1} + Δ_t u_t B_t            y_t = S_t C_t
    ⇒ S_t = e^{c_t} S_0 + Σ_{s≤t} e^{c_t − c_s} Δ_s u_s B_s           c_t = Σ_{r≤t} a_r

Two levels, as SSD passes states between chunks: the T tokens are cut into blocks of
:func:`block_size` tokens (zero-padded at the end: a padding token has a = 0 and no input, so it leaves the state as it is);

1. inside every block at once, each token's state from a zero start (the sum above over the
   block) and each block's end state;
2. across blocks, the state entering each block: the same sum over the blocks' end states with the
   blocks' total decays (all blocks at once again);
3. every state = its in-block decay times the state entering its block, plus its in-block state.

Every exponent is a masked segment sum Σ_{s<r≤t} a_r (never a difference of two large sums), so it
is ≤ 0 and nothing can overflow. The sums are products with constant 0/1 matrices (the runtime's
cumulative-sum op is slow: docs/measurements/2026-12-06-mamba1.md). The intermediates hold
T·b·I·N values (level 1) and (T/b)²·I·N (level 2), b the block size. Runs in fp32 at least (fp64 in an fp64
graph).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch



def block_size(T: int) -> int:
    """Tokens per block for a chunk of T: level 1 costs ∝ T·b, level 2 ∝ (T/b)²; the power of two
    (no padding for a power-of-two chunk) with the least T·b + (T/b)²: 4 at T = 16 and 64, 8 at
    T = 128 and 256."""
    return min((1 << k for k in range(1, max(1, T.bit_length()))), key=lambda b: T * b + (T / b) ** 2, default=2)


@lru_cache(maxsize=None)
def _sum_data(n: int) -> dict[str, np.ndarray]:
    """0/1 matrices over n positions that form the masked sums as products: ``seg`` [n*n, n], row
    (t, s) selecting the a_r with s < r ≤ t; ``before`` [n*n, n], row (k, j) the a_m with j < m < k;
    ``cum`` [n, n], row t the a_r with r ≤ t; ``ahead`` [n, n], row k the a_m with m < k; ``to_end``
    [n, n], row s the a_r with s < r; ``incl`` / ``strict`` [n, n, 1]: 1 where s ≤ t / j < k."""
    t, s, r = np.arange(n).reshape(n, 1, 1), np.arange(n).reshape(1, n, 1), np.arange(n).reshape(1, 1, n)
    f = np.float64
    return {"seg": np.logical_and(s < r, r <= t).astype(f).reshape(n * n, n),
            "before": np.logical_and(s < r, r < t).astype(f).reshape(n * n, n),
            "cum": (r[0] <= t[:, :, 0]).astype(f), "ahead": (r[0] < t[:, :, 0]).astype(f),
            "to_end": (s[0, :, 0].reshape(n, 1) < r[0]).astype(f),
            "incl": (s[:, :, 0] <= t[:, :, 0]).astype(f).reshape(n, n, 1),
            "strict": (s[:, :, 0] < t[:, :, 0]).astype(f).reshape(n, n, 1)}


def _m(n: int, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A fresh tensor per use (graph constants: a tensor made in one torch.export trace must not
    leak into the next one, so only the numpy data is cached)."""
    return torch.tensor(_sum_data(n)[name], dtype=dtype)


def selective_scan(dt: torch.Tensor, A: torch.Tensor, u: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   S0: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens: ``dt`` [T,I] (after log(1 + e^x)), ``A`` [I,N] (negative), ``u`` [T,I], ``B`` and
    ``C`` [T,N], ``S0`` [I,N]. Returns y [T,I] (no D skip) and S_T [I,N], in the dtype of the inputs."""
    T, I = dt.shape
    N = A.shape[1]
    a = dt.unsqueeze(-1) * A                                   # [T,I,N], ≤ 0
    bu = (dt * u).unsqueeze(-1) * B.unsqueeze(1)               # [T,I,N]
    if T == 1:                                                 # the recurrence itself
        S = torch.exp(a[0]) * S0 + bu[0]
        return torch.matmul(S, C.reshape(N, 1)).reshape(1, I), S
    b = min(block or block_size(T), T)
    nb = -(-T // b)
    if nb * b != T:                                            # padding tokens: a = 0, no input
        pad = torch.zeros(nb * b - T, I, N, dtype=a.dtype)
        a, bu = torch.cat([a, pad], dim=0), torch.cat([bu, pad], dim=0)
        C = torch.cat([C, torch.zeros(nb * b - T, N, dtype=C.dtype)], dim=0)
    dtype, IN = a.dtype, I * N
    ab, bub = a.reshape(nb, b, IN), bu.reshape(nb, b, IN)
    # 1. inside each block, from a zero state: S_loc[k,t] = Σ_{s≤t} e^{Σ_{s<r≤t} a_r} bu_s
    L = torch.exp(torch.matmul(_m(b, "seg", dtype), ab).reshape(nb, b, b, IN)) * _m(b, "incl", dtype)
    S_loc = (L * bub.reshape(nb, 1, b, IN)).sum(2)                         # [nb,b,IN]
    end_loc = (torch.exp(torch.matmul(_m(b, "to_end", dtype), ab)) * bub).sum(1)   # [nb,IN]: S_loc at the block's end
    c_in = torch.matmul(_m(b, "cum", dtype), ab)                           # [nb,b,IN] in-block decay so far
    # 2. across blocks: the state entering block k = Σ_{j<k} e^{Σ_{j<m<k} g_m} end_loc_j + e^{Σ_{m<k} g_m} S0
    g = ab.sum(1)                                                          # [nb,IN] each block's total decay
    if nb == 1:
        S_in = S0.reshape(1, IN)
    else:
        E = torch.exp(torch.matmul(_m(nb, "before", dtype), g).reshape(nb, nb, IN)) * _m(nb, "strict", dtype)
        S_in = (E * end_loc.unsqueeze(0)).sum(1) + torch.exp(torch.matmul(_m(nb, "ahead", dtype), g)) * S0.reshape(1, IN)
    # 3. every state
    S_all = (torch.exp(c_in) * S_in.unsqueeze(1) + S_loc).reshape(nb * b, I, N)
    y = torch.matmul(S_all, C.reshape(nb * b, N, 1)).reshape(nb * b, I)
    return y[:T], S_all[T - 1]
