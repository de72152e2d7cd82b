"""The exact chunk form of Mamba-1's selective scan, from standard ops only (no loop over tokens).

Per channel i and state n, token t (the decay is per (i, n): A is a matrix, so Mamba-2's scalar
per-head form does not apply), with a_t = Δ_t[i]·A[i, n] ≤ 0 (A = −exp(A_log)):

    S_t = e^{a_t} S_{t−1} + Δ_t u_t B_t            y_t = S_t C_t
    ⇒ S_t = e^{c_t} S_0 + Σ_{s≤t} e^{c_t − c_s} Δ_s u_s B_s           c_t = Σ_{r≤t} a_r

Levels, as SSD passes states between chunks (:func:`inclusive`): the tokens are cut into blocks of
:data:`BLOCK` (zero-padded at the end: a padding token has a = 0 and no input, so it leaves the
state as it is);

1. inside every block at once, each token's state from a zero start (the sum above over the
   block), each block's total decay and end state;
2. the state entering each block is the state after the block before: the same problem over the
   blocks (one "token" per block: its total decay and end state, shifted by one block), solved by
   the same function, down to BLOCK tokens or fewer, where the sum is formed directly;
3. every state = its in-block decay times the state entering its block, plus its in-block state.

S_0 enters as part of the first token's input (e^{a_0} S_0 + Δ_0 u_0 B_0). Every exponent is a
masked segment sum Σ_{s<r≤t} a_r (never a difference of two large sums), so it is ≤ 0 and nothing
can overflow. The sums, the shift and the picks of a row are products with constant 0/1 matrices
(the runtime's cumulative-sum, slice and concat ops are slow: docs/measurements/2026-12-06-mamba1.md).
The largest intermediate holds T·BLOCK·I·N values; the levels below it a BLOCK-th of the one above.
Runs in fp32 at least (fp64 in an fp64 graph).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

BLOCK = 2   # tokens per block at every level: the work is ∝ T·BLOCK·(1 + 1/BLOCK + ...); 2 measured best


@lru_cache(maxsize=None)
def _sum_data(n: int) -> dict[str, np.ndarray]:
    """0/1 matrices over n positions: ``seg`` [n*n, n], row (t, s) selecting the a_r with
    s < r ≤ t; ``cum`` [n, n], row t the a_r with r ≤ t; ``incl`` [n, n, 1], 1 where s ≤ t;
    ``shift`` [n, n], row k picking k − 1 (row 0 empty); ``first`` [1, n] and ``last`` [1, n]
    picking position 0 and n − 1; ``put_first`` [n, 1], 1 at row 0."""
    t, s, r = np.arange(n).reshape(n, 1, 1), np.arange(n).reshape(1, n, 1), np.arange(n).reshape(1, 1, n)
    f, i = np.float64, np.arange(n)
    return {"seg": np.logical_and(s < r, r <= t).astype(f).reshape(n * n, n),
            "cum": (r[0] <= t[:, :, 0]).astype(f),
            "incl": (s[:, :, 0] <= t[:, :, 0]).astype(f).reshape(n, n, 1),
            "shift": (i.reshape(n, 1) - 1 == i.reshape(1, n)).astype(f),
            "first": (i == 0).astype(f).reshape(1, n), "last": (i == n - 1).astype(f).reshape(1, n),
            "put_first": (i == 0).astype(f).reshape(n, 1)}


def _m(n: int, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A fresh tensor per use (graph constants: a tensor made in one torch.export trace must not
    leak into the next one, so only the numpy data is cached)."""
    return torch.tensor(_sum_data(n)[name], dtype=dtype)


def inclusive(a: torch.Tensor, bu: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Every state S_t = e^{a_t} S_{t−1} + bu_t from S_{−1} = 0: ``a`` (≤ 0) and ``bu`` [n, X];
    returns [n, X]."""
    n, X = a.shape
    dtype = a.dtype
    if n <= block:                                             # the sum directly, [n, n, X]
        L = torch.exp(torch.matmul(_m(n, "seg", dtype), a).reshape(n, n, X)) * _m(n, "incl", dtype)
        return (L * bu.unsqueeze(0)).sum(1)
    b = block
    nb = -(-n // b)
    if nb * b != n:                                            # padding tokens: a = 0, no input
        pad = torch.zeros(nb * b - n, X, dtype=dtype)
        a, bu = torch.cat([a, pad], dim=0), torch.cat([bu, pad], dim=0)
    ab, bub = a.reshape(nb, b, X), bu.reshape(nb, b, X)
    # 1. inside each block, from a zero state
    L = torch.exp(torch.matmul(_m(b, "seg", dtype), ab).reshape(nb, b, b, X)) * _m(b, "incl", dtype)
    S_loc = (L * bub.reshape(nb, 1, b, X)).sum(2)                          # [nb,b,X]
    c_in = torch.matmul(_m(b, "cum", dtype), ab)                           # [nb,b,X] in-block decay so far
    g = ab.sum(1)                                                          # [nb,X] each block's total decay
    e = torch.matmul(_m(b, "last", dtype), S_loc).reshape(nb, X)           # [nb,X] each block's end state
    # 2. the state entering block k is the state after block k − 1: the blocks as tokens, shifted by one
    shift = _m(nb, "shift", dtype)
    entering = inclusive(torch.matmul(shift, g), torch.matmul(shift, e), block)
    # 3. every state
    S = (torch.exp(c_in) * entering.reshape(nb, 1, X) + S_loc).reshape(nb * b, X)
    return S if nb * b == n else S[:n]


def selective_scan(dt: torch.Tensor, A: torch.Tensor, u: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   S0: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens: ``dt`` [T,I] (after log(1 + e^x)), ``A`` [I,N] (negative), ``u`` [T,I], ``B`` and
    ``C`` [T,N], ``S0`` [I,N]. Returns y [T,I] (no D skip) and S_T [I,N], in the dtype of the inputs."""
    if block < 2:
        raise ValueError(f"block must be at least 2, got {block}")
    T, I = dt.shape
    N = A.shape[1]
    a = dt.unsqueeze(-1) * A                                   # [T,I,N], ≤ 0
    bu = (dt * u).unsqueeze(-1) * B.unsqueeze(1)               # [T,I,N]
    if T == 1:                                                 # the recurrence itself
        S = torch.exp(a[0]) * S0 + bu[0]
        return torch.matmul(S, C.reshape(N, 1)).reshape(1, I), S
    dtype, IN = a.dtype, I * N
    a, bu = a.reshape(T, IN), bu.reshape(T, IN)
    # S_0 enters with the first token: its input becomes e^{a_0} S_0 + bu_0
    first = torch.exp(torch.matmul(_m(T, "first", dtype), a)) * S0.reshape(1, IN)     # [1,IN]
    S_all = inclusive(a, bu + torch.matmul(_m(T, "put_first", dtype), first), block).reshape(T, I, N)
    y = torch.matmul(S_all, C.reshape(T, N, 1)).reshape(T, I)
    return y, torch.matmul(_m(T, "last", dtype), S_all.reshape(T, IN)).reshape(I, N)
