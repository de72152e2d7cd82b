"""The gated delta rule, token by token and in its exact chunk (WY/UT) form, from standard ops.

Per value head (the state S is [K, V]: key rows, value columns), token t with q_t, k_t [K]
(L2-normalised; q scaled by 1/sqrt(K)), v_t [V], the decay g_t = -exp(A_log) log(1 + e^(a_t + dt_bias))
(<= 0) and the write strength beta_t = sigmoid(b_t) (x2 with allow_neg_eigval):

    S <- exp(g_t) S                          (decay)
    u_t = beta_t (v_t - S^T k_t)              (the delta: what S predicts for k_t, corrected)
    S <- S + k_t u_t^T                        (rank-1 write)
    o_t = S^T q_t                             [V]

The pieces are module functions (:func:`l2norm`, :func:`gate`, :func:`beta`, :func:`delta_step`,
:func:`chunk`) that the reference and the export modules both call, so a test can break one piece
and see the whole model disagree with fla.

Chunk form over T tokens (exact up to rounding; fp32 at least inside the chunk). With
c_t = sum_{r<=t} g_r and every exponent written as a masked segment sum (<= 0: nothing overflows):

    A[t,j] = beta_t exp(c_t - c_j) (k_t . k_j)        j < t  (strictly lower)
    U = (I + A)^-1 (beta V - beta exp(c) (K S_0))     rows u_t
    O = exp(c) (Q S_0) + ((Q K^T) o exp(c_t - c_j), j <= t) U
    S_T = exp(c_T) S_0 + (K o exp(c_T - c_j))^T U

(I + A)^-1 of the unit lower-triangular matrix is built by block doubling, log2(T) levels and no
triangular solve (which Core AI does not lower): X starts as I, the inverse of the 1x1 diagonal
blocks; at each level b = 1, 2, 4 ... the diagonal blocks of size 2b are [[L1, 0], [L21, L2]], whose
inverse is D - D N D with D = diag(L1^-1, L2^-1) (the current X) and N = [[0, 0], [L21, 0]] (N D N = 0),
so X <- X - X (A o M_b) X with M_b the mask of those lower-left sub-blocks. Every factor is a true
inverse of a diagonal block (bounded), unlike the power product (I - A)(I + A^2)(I + A^4)..., whose
powers of A reach 1e5 on correlated keys and cancel catastrophically in fp32 (found by
tests/families/test_gdn_official.py against fla's naive rule).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

# fla's q/k L2 norm eps (fla/modules/norm/l2norm.py ``l2norm(x, eps=1e-6)``, used in-kernel by the
# fused_recurrent and chunk rules alike): fixed, not F.normalize's 1e-12, not a norm_eps of the config.
# The one place it is written (geometry.py had a second, unused copy).
L2_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's q/k normalisation over the last axis: x / sqrt(sum x^2 + 1e-6)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def log1p_exp(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x) written so that no intermediate overflows (max(x, 0) + log1p(e^-|x|)): the library
    op's decomposition forms e^x first, which overflows fp16 on a device delegate (coreai doctor)."""
    return torch.clamp(x, min=0) + torch.log1p(torch.exp(-torch.abs(x)))


def gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """The log-decay g = -exp(A_log) log(1 + e^(a + dt_bias)), <= 0; a [..., Hv]."""
    return -torch.exp(A_log) * log1p_exp(a + dt_bias)


def beta(b: torch.Tensor, allow_neg_eigval: bool) -> torch.Tensor:
    """The write strength sigmoid(b), doubled with allow_neg_eigval (eigenvalues of I - beta k k^T in [-1, 1])."""
    s = torch.sigmoid(b)
    return s * 2.0 if allow_neg_eigval else s


def heads_of(t: torch.Tensor, hv: int, axis: int) -> torch.Tensor:
    """q/k heads -> value heads along ``axis`` (GVA: v head i reads q/k head i // (Hv/H)), by expand +
    reshape (no copy per head); unchanged when the counts match."""
    h = t.shape[axis]
    if h == hv:
        return t
    shape = list(t.shape)
    t = t.unsqueeze(axis + 1)
    expanded = shape[:axis + 1] + [hv // h] + shape[axis + 1:]
    return t.expand(*expanded).reshape(*shape[:axis], hv, *shape[axis + 1:])


def delta_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token, all heads: S [Hv,K,V], q and k [Hv,K] (normalised, q scaled), v [Hv,V], g and b [Hv]
    (log-decay, beta). Returns o [Hv,V] and the new S."""
    S = S * torch.exp(g).reshape(-1, 1, 1)
    pred = (S * k.unsqueeze(-1)).sum(-2)                                  # S^T k  [Hv,V]
    u = (v - pred) * b.unsqueeze(-1)
    S = S + k.unsqueeze(-1) * u.unsqueeze(-2)
    o = (S * q.unsqueeze(-1)).sum(-2)                                     # S^T q
    return o, S


@lru_cache(maxsize=None)
def _mask_data(T: int) -> tuple[np.ndarray, ...]:
    """strict (j < t), inclusive (j <= t), the identity, then one block-doubling mask per level
    b = 1, 2, 4 ... < T: (t, j) in the same 2b-block, t in its lower half and j in its upper half."""
    i, s = np.arange(T).reshape(T, 1), np.arange(T).reshape(1, T)
    levels = []
    b = 1
    while b < T:
        levels.append(((i // (2 * b) == s // (2 * b)) & ((i // b) % 2 == 1) & ((s // b) % 2 == 0)).astype(np.float64))
        b *= 2
    return ((i > s).astype(np.float64), (i >= s).astype(np.float64), np.eye(T), *levels)


def _masks(T: int, dtype: torch.dtype):
    """Fresh graph constants per call (a tensor made in one torch.export trace must not leak into the
    next): only the numpy data is cached."""
    return tuple(torch.tensor(m, dtype=dtype) for m in _mask_data(T))


def unit_lower_inverse(A: torch.Tensor, eye: torch.Tensor, levels) -> torch.Tensor:
    """(I + A)^-1 for A [..., T, T] strictly lower triangular, by block doubling (module doc)."""
    X = eye.expand(A.shape)
    for mask in levels:
        X = X - torch.matmul(torch.matmul(X, A * mask), X)
    return X


def chunk(S0: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
          b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens at once, all heads batched: S0 [Hv,K,V]; q, k [Hv,T,K] (normalised, q scaled);
    v [Hv,T,V]; g, b [Hv,T]. Returns O [Hv,T,V] and S_T [Hv,K,V], in the inputs' dtype."""
    Hv, T, _ = k.shape
    strict, incl, eye, *levels = _masks(T, k.dtype)
    seg = torch.cumsum(g.reshape(Hv, T, 1) * strict, dim=1)           # [h,t,j] = sum_{j<r<=t} g_r (t >= j), else 0
    decay = torch.exp(seg)                                             # exp(c_t - c_j), <= 1
    c = torch.cumsum(g, dim=1)                                         # [Hv,T] inclusive
    kk = torch.matmul(k, k.transpose(-1, -2))                          # [Hv,T,T] k_t . k_j
    A = kk * decay * strict * b.reshape(Hv, T, 1)                      # strictly lower
    inv = unit_lower_inverse(A, eye, levels)                           # (I + A)^-1
    ec = torch.exp(c).reshape(Hv, T, 1)
    rhs = (v - torch.matmul(k, S0) * ec) * b.reshape(Hv, T, 1)         # beta (v - exp(c) K S_0)
    U = torch.matmul(inv, rhs)                                         # [Hv,T,V]
    qk = torch.matmul(q, k.transpose(-1, -2)) * decay * incl           # causal, j <= t
    O = torch.matmul(q, S0) * ec + torch.matmul(qk, U)
    to_end = decay[:, T - 1, :].reshape(Hv, T, 1)                      # exp(c_T - c_j)
    S_T = S0 * torch.exp(c[:, T - 1:T]).reshape(Hv, 1, 1) + torch.matmul((k * to_end).transpose(-1, -2), U)
    return O, S_T


def conv_silu(prev: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's short conv for one token: window [D,K] (newest last) with x [D] appended,
    silu(sum_k window[:, k] weight[:, 0, k]). Returns the activation and the new window."""
    window = torch.cat([prev[:, 1:], x[:, None]], dim=1)
    return F.silu((window * weight[:, 0, :]).sum(-1)), window
