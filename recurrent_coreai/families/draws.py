"""The seeded-draw policy of every family's synthetic weights: one ``torch.Generator`` per model,
seeded once, draws every tensor in the family's ``normal_shapes`` order (a tensor's values depend
on every tensor before it); values are drawn in float64 and cast to float32 once, at the end.

The API, for a family's ``synthetic.py``::

    from recurrent_coreai.families.draws import Draws

    def synthetic_tensors(g, seed):
        d = Draws(seed)                          # torch.Generator().manual_seed(seed), float64 draws
        for name, shape in normal_shapes(g).items():
            yield name, init(name, shape, d)     # one tensor at a time, in that order

    d.normal(shape, std)              # N(0, std^2)               -> float32
    d.uniform(shape, lo, hi)          # U[lo, hi)                 -> float32
    d.log_uniform(shape, lo, hi)      # exp(U[log lo, log hi))    -> float32 (e.g. a step size dt)
    d.normal(shape, std, exact=True)  # any of them in the draw dtype (float64), to compute on
                                      # before the one cast: e.g. rows = torch.exp(d.normal((V, 1),
                                      # 0.4, exact=True)); (d.normal(shape, s, exact=True) * rows).float()

Each is ``torch.randn`` / ``torch.rand`` of the shape from ``d.gen`` in the draw dtype, scaled in
that dtype (``randn * std``; ``rand * (hi - lo) + lo``; ``exp(rand * (log hi - log lo) + log lo)``),
then cast. A normal draw is made :data:`RANDN_CHUNK` values per call, so a 65536 x 2048 table needs
no float64 copy of itself; the values and the generator's state after are exactly those of one
call (torch's CPU sampler turns uniforms into normals in blocks of 16 and redraws the last 16 of a
call whose size is not a multiple of 16: calls of a multiple of 16 values, then one of at least
16, draw what one call draws; tests/test_synthetic.py checks it).

``Draws(seed, dtype=torch.float32)`` draws in float32 instead: only RWKV-6 does, whose synthetic
weights were drawn that way before this module (its tiny bundles' bytes depend on it). A new
family uses the float64 default.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

RANDN_CHUNK = 1 << 20  # normal values drawn per call (8 MB in float64; a multiple of 16: see the docstring)

Shape = Sequence[int]


def chunked_normal(shape: Shape, std: float, gen: torch.Generator, dtype: torch.dtype = torch.float64,
                   out_dtype: torch.dtype = torch.float32, chunk: int = RANDN_CHUNK) -> torch.Tensor:
    """``torch.randn(shape, generator=gen, dtype=dtype).mul(std).to(out_dtype)``, the same values and
    the same generator state after, drawn ``chunk`` values at a time (a multiple of 16)."""
    out = torch.empty(tuple(shape), dtype=out_dtype)
    flat, at = out.view(-1), 0
    while at < flat.numel():
        n = flat.numel() - at if flat.numel() - at < 2 * chunk else chunk
        flat[at:at + n] = torch.randn(n, generator=gen, dtype=dtype).mul_(std)  # the one cast, if any
        at += n
    return out


class Draws:
    """One model's draws: ``gen`` (seeded once) and the draw dtype (float64; see the module docstring)."""

    def __init__(self, seed: int, dtype: torch.dtype = torch.float64):
        if dtype not in (torch.float64, torch.float32):
            raise ValueError(f"draws are made in float64 (or float32), not {dtype}")
        self.gen = torch.Generator().manual_seed(int(seed))
        self.dtype = dtype

    def _out(self, t: torch.Tensor, exact: bool) -> torch.Tensor:
        return t if exact else t.float()

    def normal(self, shape: Shape, std: float = 1.0, exact: bool = False) -> torch.Tensor:
        """N(0, std^2) in ``shape``: float32, or the draw dtype with ``exact``."""
        return chunked_normal(shape, std, self.gen, self.dtype, self.dtype if exact else torch.float32, RANDN_CHUNK)

    def uniform(self, shape: Shape, lo: float, hi: float, exact: bool = False) -> torch.Tensor:
        """U[lo, hi) in ``shape``: float32, or the draw dtype with ``exact``."""
        return self._out(torch.rand(tuple(shape), generator=self.gen, dtype=self.dtype) * (hi - lo) + lo, exact)

    def log_uniform(self, shape: Shape, lo: float, hi: float, exact: bool = False) -> torch.Tensor:
        """exp(U[log lo, log hi)) in ``shape`` (0 < lo < hi): float32, or the draw dtype with ``exact``."""
        u = torch.rand(tuple(shape), generator=self.gen, dtype=self.dtype)
        return self._out(torch.exp(u * (math.log(hi) - math.log(lo)) + math.log(lo)), exact)
