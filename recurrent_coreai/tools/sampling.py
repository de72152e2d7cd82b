"""Choosing the next token from logits: greedy, or seeded temperature / top-k / top-p sampling,
with an optional repetition penalty. numpy only (the runtime hands back numpy logits).

Order of operations (the one Hugging Face ``generate`` uses): repetition penalty, then greedy
argmax — or temperature, top-k, top-p, softmax and a draw from a seeded generator.
"""

from __future__ import annotations

import math
import secrets
import sys
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from recurrent_coreai.util.errors import PipelineError


SMALLEST = sys.float_info.min  # the smallest positive normal float: below it 1/x and x/y overflow


def _positive(x: float) -> bool:
    """A positive, finite, normal number (not NaN, not infinite, not subnormal)."""
    return math.isfinite(x) and x >= SMALLEST


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut
    repetition_penalty: float = 1.0  # 1: none; >1 discourages tokens already in the context
    seed: int | None = None  # None: a fresh seed (reported, so the run can be repeated)

    def check(self, vocab: int | None = None) -> "Sampling":
        """Raises a one-line error for an out-of-range setting; returns self. With ``vocab`` (the
        number of logits) top-k is also checked against it."""
        bad = [("--temperature", self.temperature == 0 or _positive(self.temperature),
                f"use 0 (greedy) or a finite positive value of at least {SMALLEST!r}"),
               ("--top-k", self.top_k >= 0, "use 0 (off) or a positive count"),
               ("--top-p", 0 < self.top_p <= 1, "use a value in (0, 1]; 1 turns it off"),
               ("--repetition-penalty", _positive(self.repetition_penalty),
                f"use a finite positive value of at least {SMALLEST!r}; 1 turns it off")]
        for flag, ok, fix in bad:
            if not ok:
                value = getattr(self, flag[2:].replace("-", "_"))
                raise PipelineError(flag, f"{value} is out of range", fix)
        if vocab is not None and self.top_k > vocab:
            raise PipelineError("--top-k", f"{self.top_k} is more than the model's {vocab} tokens",
                                f"use 0 (off) or a count from 1 to {vocab}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def penalize(logits: np.ndarray, seen: Iterable[int], penalty: float) -> np.ndarray:
    """CTRL-style repetition penalty: for every token id in ``seen``, a positive logit is divided
    by ``penalty`` and a negative one multiplied by it (a copy; ``logits`` is left alone)."""
    out = np.array(logits, dtype=np.float64)
    if penalty == 1.0:
        return out
    ids = np.fromiter(set(seen), dtype=np.int64)
    if ids.size:
        vals = out[ids]
        with np.errstate(over="ignore"):
            out[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
        big = np.finfo(np.float64).max  # a small penalty must not make a logit infinite (inf - inf is NaN)
        np.clip(out, -big, big, out=out)
    return out


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The sampling distribution over the vocabulary after temperature, top-k and top-p."""
    z = np.asarray(logits, dtype=np.float64)
    with np.errstate(over="ignore"):
        z = (z - z.max()) / temperature  # <= 0: a small temperature gives -inf (probability 0), never inf
    if 0 < top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p)) + 1]  # smallest prefix with mass >= top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


class Sampler:
    """``sampler(logits, context) -> token id``; the same seed gives the same tokens."""

    def __init__(self, cfg: Sampling):
        self.cfg = cfg.check()
        self.seed = cfg.seed if cfg.seed is not None else secrets.randbits(32)
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, logits: np.ndarray, context: Iterable[int] = ()) -> int:
        c = self.cfg.check(vocab=np.size(logits)) if self.cfg.top_k else self.cfg
        z = penalize(logits, context, c.repetition_penalty)
        if c.greedy:
            return int(np.argmax(z))
        p = filtered_probs(z, c.temperature, c.top_k, c.top_p)
        return int(self.rng.choice(p.size, p=p))
