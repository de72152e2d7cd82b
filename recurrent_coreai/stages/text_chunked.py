"""The text stream's reference in the family's chunked fp32 form, for models where token by token
costs too much (the 1.5B shape: 2048 steps 1093 s against 368 s chunked with the check, on 2
threads: docs/measurements/2026-12-06-text-reference.md).

The form is the family's own fp32 modules run in torch: ``build_decode`` (one token) and
``build_prefill`` (a chunk at once, the family's exact chunked scan) over the same weights and state
buffers, through the text stream's plan exactly as the bundle runs it
(:func:`entrypoints.text_plan`: the chunks before each horizon token by token, the others as
prefill chunks). A prefill call reads each weight once for ``chunk`` tokens, where a step reads
every weight per token.

Those modules are what the export lowers, so on their own they would check only the lowering. So
every model run this way is first checked against the token-by-token reference
(:func:`checked`): the stream's first horizon (a prefill chunk, then a chunk through decode) both
ways, the logits at every position either reports and every state at that horizon. A difference
above ``reference.chunked.max_abs_dlogits`` (logits) or ``max_rel_dstate`` (each state, on its own
scale) stops the stage: nothing is gated on a form that this model's oracle does not confirm.
The stream then carries the check's numbers (``text_check_*``).
"""

from __future__ import annotations

import numpy as np
import torch

from recurrent_coreai.coreai.entrypoints import DECODE, text_plan
from recurrent_coreai.util.errors import PipelineError

CHECK_KEYS = ("text_check_tokens", "text_check_max_dlogits", "text_check_max_rel_dstate")


def chunked_text_stream(family, weights, geom, tokens: np.ndarray, chunk: int, horizons: list[int]) -> dict:
    """The text stream (keys as :func:`stages.reference.text_stream`'s) through the family's fp32
    decode and prefill modules in torch, from zero states."""
    tokens = np.asarray(tokens, np.int64)
    dec = family.build_decode(weights, geom, torch.float32).eval()
    pre = family.build_prefill(dec, chunk).eval()
    names = [spec.name for spec in family.state_specs(geom)]
    at_horizon = set(horizons)
    logit_pos, logits, states = [], [], {}

    def call(module, a: int, b: int) -> np.ndarray:
        ids = torch.tensor(tokens[a:b], dtype=torch.int32).reshape(1, b - a)
        pos = torch.arange(a, b, dtype=torch.int32).reshape(1, b - a)
        return module(ids, pos)[0, -1].numpy().astype(np.float32)

    with torch.no_grad():
        for fn, a, b in text_plan(len(tokens), chunk, horizons):
            if fn == DECODE:
                for p in range(a, b):
                    logit_pos.append(p)
                    logits.append(call(dec, p, p + 1))
            else:
                logit_pos.append(b - 1)
                logits.append(call(pre, a, b))
            if b in at_horizon:
                for name in names:
                    states.setdefault(name, []).append(getattr(dec, name).detach().float().numpy().copy())
    out = {"text_tokens": tokens, "text_horizons": np.array(horizons, np.int64),
           "text_logit_pos": np.array(logit_pos, np.int64), "text_logits": np.stack(logits)}
    out.update({f"text_state_{name}": np.stack(v) for name, v in states.items()})
    return out


def compare(chunked: dict, steps: dict) -> tuple[float, float]:
    """(max|Δlogits| over the positions both report, the worst state's max|Δ| / max|state|) between
    two text streams over the same tokens (``steps``: the shorter, token by token)."""
    pos = {int(p): i for i, p in enumerate(chunked["text_logit_pos"])}
    if any(int(p) not in pos for p in steps["text_logit_pos"]):
        raise ValueError("the two text streams report different positions")
    rows = [pos[int(p)] for p in steps["text_logit_pos"]]
    dl = float(np.abs(chunked["text_logits"][rows].astype(np.float64) - steps["text_logits"]).max())
    rel = 0.0
    for key, want in steps.items():
        if key.startswith("text_state_"):
            got = chunked[key][: len(want)].astype(np.float64)
            scale = max(float(np.abs(want).max()), 1e-30)
            rel = max(rel, float(np.abs(got - want).max()) / scale)
    return dl, rel


def checked(family, weights, geom, tokens: np.ndarray, chunk: int, horizons: list[int], limits: dict,
            steps: dict, where: str) -> dict:
    """:func:`chunked_text_stream` over the whole text, once it agreed with ``steps`` (the
    token-by-token reference's text stream over the first horizon: stages/reference.text_stream)
    within ``limits`` (max_abs_dlogits, max_rel_dstate); the stream carries the check
    (``text_check_*``). One line naming ``where`` when it does not agree."""
    first = int(max(steps["text_horizons"]))
    out = chunked_text_stream(family, weights, geom, tokens, chunk, horizons)
    dl, rel = compare(out, steps)
    if not (dl <= limits["max_abs_dlogits"] and rel <= limits["max_rel_dstate"]):
        raise PipelineError(where, f"the chunked fp32 form of the text stream disagrees with the token-by-token "
                            f"reference over its first {first} tokens: max|dlogits| {dl:.3g} (limit "
                            f"{limits['max_abs_dlogits']:g}), worst state {rel:.3g} of its scale (limit "
                            f"{limits['max_rel_dstate']:g})", "run this model's text stream token by token "
                            "(raise reference.chunked.from_params above its parameter count) and report the "
                            "family's chunked form as a bug")
    out.update({"text_check_tokens": np.array(first, np.int64), "text_check_max_dlogits": np.array(dl),
                "text_check_max_rel_dstate": np.array(rel)})
    return out
