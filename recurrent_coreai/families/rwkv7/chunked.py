"""The exact chunked form of the WKV7 recurrence, from standard ops only (no custom kernel).

Per head (fla orientation, S is K×V), token t of a chunk:

    S_t = diag(w_t) S_{t-1} − (kk_t a_t)(kk_tᵀ S_{t-1}) + k_t v_tᵀ ;   o_t = S_tᵀ r_t

With α_t = −kk_t⊙a_t and u_tᵀ = kk_tᵀ S_{t-1} (what the delta term reads), this is a diagonal
linear recurrence driven by α_t u_tᵀ + k_t v_tᵀ. With the cumulative log-decay c_t = Σ_{s≤t} log w_s
(inclusive) and its exclusive form c_t − log w_t, over the T tokens of a chunk (rows = tokens):

    U = (I − L_a)⁻¹ (kk⊙e^{c_excl} S_0 + L_k V)                 the T rows u_tᵀ
        L_a = strict_tril((kk⊙e^{c_excl−m}) (α⊙e^{m−c})ᵀ),  L_k = same with k for α
    O = r⊙e^{c} S_0 + tril((r⊙e^{c−m}) (α⊙e^{m−c})ᵀ) U + tril((r⊙e^{c−m}) (k⊙e^{m−c})ᵀ) V
    S_T = e^{c_T} ⊙ S_0 + (α⊙e^{c_T−c})ᵀ U + (k⊙e^{c_T−c})ᵀ V

The inverse of the unit lower-triangular I − L_a is built from matmuls only (coreai-torch 0.4.3 has
no lowering for ``aten.linalg_solve_triangular``): block doubling X ← X + X (L ⊙ M_b) X, where M_b
keeps the entries that join two neighbouring diagonal blocks of size b into one of size 2b.
ceil(log2 T) levels, exact (each level is the 2×2 block-triangular inverse formula), and every
intermediate is a sub-block of the true inverse, so nothing grows the way a Neumann power series can.

``m`` = c_T/2 centres the exponents: the factors lie in e^{±|c_T|/2} with |c_T| ≤ 0.6065·T (the
decay w ≥ e^{−e^{−0.5}}), e.g. e^{±19.4} at T = 64, and the s > t products (formed, then masked)
reach e^{|c_T|} (see MAX_CHUNK). fp32 holds that up to T = 128; fp16 (max 65504 ≈ e^{11.1}) does
not: the products overflow from T ≈ 16–24 on and inf·0 turns the chunk into NaN. So the chunk
runs in fp32 inside an fp16 graph (``compute_dtype``); measured in tests/test_chunked.py.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

# The factorised products are formed for every (t, s) pair before the causal mask zeroes the
# s > t half, and those entries reach e^{0.6065·T} (strongest decay): 64 of them summed must stay
# below fp32's max (e^{88.7}), so T ≤ 139. 128 keeps a margin.
MAX_CHUNK = 128
assert 64 * math.exp(math.exp(-0.5) * MAX_CHUNK) < torch.finfo(torch.float32).max


@lru_cache(maxsize=None)
def _mask_data(T: int) -> tuple[np.ndarray, ...]:
    """[T,T] 0/1 masks as numpy: strictly lower, lower with diagonal, identity, then one doubling
    mask per level of :func:`unit_lower_inverse`."""
    i, s = np.arange(T).reshape(T, 1), np.arange(T).reshape(1, T)
    masks = [i > s, i >= s, i == s]
    b = 1
    while b < T:
        masks.append((i > s) & (i // (2 * b) == s // (2 * b)) & (i // b != s // b))
        b *= 2
    return tuple(m.astype(np.float64) for m in masks)


def _masks(T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """The masks as fresh tensors (constants of the exported graph). Only the numpy data is
    cached: a tensor made inside one torch.export trace is a fake tensor of that trace and
    must not leak into the next one."""
    strict, incl, eye, *levels = (torch.tensor(m, dtype=dtype) for m in _mask_data(T))
    return strict, incl, eye, tuple(levels)


def unit_lower_inverse(L: torch.Tensor, masks=None) -> torch.Tensor:
    """(I − L)⁻¹ for strictly lower-triangular L [..., T, T], by matmuls only (block doubling).
    ``masks``: the :func:`_masks` of L's size and dtype, if the caller has them already."""
    _, _, eye, levels = masks or _masks(L.shape[-1], L.dtype)
    X = eye
    for mask in levels:
        X = X + torch.matmul(torch.matmul(X, L * mask), X)
    return X


def wkv_chunk(r, k, v, kk, a, logw, S, compute_dtype: torch.dtype | None = None):
    """T tokens of the WKV7 recurrence at once, all heads batched.

    r, k, v, kk, a, logw: [H, T, N] (k after the k_a update, kk L2-normalised, logw = log decay);
    S: [H, K, V] the state before the chunk. Returns (o [H, T, V], S_T [H, K, V]) in the dtypes of
    v and S. The chunk runs in ``compute_dtype``; by default in the widest of v, S and fp32 (an fp16
    graph computes its chunks in fp32, an fp64 one in fp64).
    """
    out_dtype, state_dtype = v.dtype, S.dtype
    dt = compute_dtype or (torch.float64 if torch.float64 in (v.dtype, S.dtype) else torch.float32)
    r, k, v, kk, a, logw, S0 = (t.to(dt) for t in (r, k, v, kk, a, logw, S))
    T = r.shape[-2]
    masks = _masks(T, dt)
    strict, incl = masks[:2]
    alpha = -kk * a
    c = torch.cumsum(logw, dim=-2)                # inclusive: decay up to and including token t
    c_ex = c - logw                               # exclusive: what u_t (read before token t's decay) sees
    c_T = c[:, T - 1:T, :]                        # [H,1,N]
    m = 0.5 * c_T
    grow, shrink = torch.exp(m - c), torch.exp(c_T - c)
    kk_d = kk * torch.exp(c_ex - m)
    r_d = r * torch.exp(c - m)
    alpha_gT, k_gT = (alpha * grow).transpose(-1, -2), (k * grow).transpose(-1, -2)      # [H,N,T]
    L_a = torch.matmul(kk_d, alpha_gT) * strict
    L_k = torch.matmul(kk_d, k_gT) * strict
    U = torch.matmul(unit_lower_inverse(L_a, masks),
                     torch.matmul(kk * torch.exp(c_ex), S0) + torch.matmul(L_k, v))      # [H,T,V]
    o = (torch.matmul(r * torch.exp(c), S0)
         + torch.matmul(torch.matmul(r_d, alpha_gT) * incl, U)
         + torch.matmul(torch.matmul(r_d, k_gT) * incl, v))
    S_T = (torch.exp(c_T).transpose(-1, -2) * S0
           + torch.matmul((alpha * shrink).transpose(-1, -2), U)
           + torch.matmul((k * shrink).transpose(-1, -2), v))
    return o.to(out_dtype), S_T.to(state_dtype)
