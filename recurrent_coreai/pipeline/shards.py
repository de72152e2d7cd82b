"""How the gate's work splits into shards: separate jobs (``gate_shard``) a cluster can place on
separate nodes, gathered by the ``gate`` job into one verdict.

The gate's work is the prefill check (one unit, from zero states) and the decode steps of each
prompt. A shard is a list of *pieces*: the prefill check, or a run of one prompt's steps
``start..stop``. A piece that starts mid-prompt first feeds the prompt's earlier tokens through
the bundle's own functions -- its ``prefill`` in full chunks, ``main`` for the rest -- comparing
nothing, then compares its steps of ``main``: the engine's own state is the start (the prefill
path is gated on its own by the prefill check). That warm-up is paid again by every shard that
starts mid-prompt, so the plan cuts a prompt only where that shortens the longest shard.

Costs are counted in decode calls (one ``main`` call = 1). A ``prefill`` call of ``chunk`` tokens
costs :func:`prefill_call_cost` of them: measured in the Linux runtime (docs/benchmarks.md,
``bench/bench_prefill.py``) a 64-token call cost 3.3 decode calls at the 0.1B shape (19.4x
speedup) and 3.8 on gdn-tiny; 1 + chunk/20 is at or above every measured value (16: 1.45, 64: 3.3,
128: 7.1 at 0.1B). Int8 calls at scale are dominated by dequantising the weights, which a prefill
call does once as well, so this overestimates them: a plan never relies on cheap prefill.

Pure functions of the stream's shape, so Snakemake can count the shards when it builds the DAG
(:func:`shard_count`, from the configured steps) and the shard and gather jobs plan the same
pieces from the reference stream itself (:func:`plan`).
"""

from __future__ import annotations

import math
from typing import Sequence

from recurrent_coreai.coreai.entrypoints import PREFILL as PREFILL_RUN, text_piece

PREFILL = "prefill"  # the piece that is the prefill check
TEXT = "text"  # the piece that is the long text stream (stages/gate.py: text_check)
EPS = 1e-6  # costs within this of a limit fit it (the limit is found by bisection)


def prefill_call_cost(chunk: int) -> float:
    """One ``prefill`` call of ``chunk`` tokens, in decode calls (see the module docstring)."""
    return 1.0 + chunk / 20.0


def warmup_cost(offset: int, chunk: int) -> float:
    """Feeding a prompt's first ``offset`` tokens: full chunks through prefill, the rest through main."""
    return (offset // chunk) * prefill_call_cost(chunk) + offset % chunk


def prefill_check_cost(tokens: int, chunk: int) -> float:
    """The prefill check: ``tokens`` in full chunks through prefill, the tail through main."""
    return warmup_cost(tokens, chunk)


def text_piece_cost(text: tuple[int, Sequence[int]], chunk: int, idx: Sequence[int] | None = None) -> float:
    """One part of the text stream of ``text`` = (tokens, horizons): the horizons ``idx`` (None:
    all), run from zero states as coreai/entrypoints.text_piece plans it (prefill calls at
    :func:`prefill_call_cost`, main calls at 1)."""
    runs, _, _ = text_piece(text[0], chunk, list(text[1]), None if idx is None else list(idx))
    return sum(prefill_call_cost(chunk) if fn == PREFILL_RUN else b - a for fn, a, b in runs)


def text_check_cost(text: tuple[int, Sequence[int]] | None, chunk: int) -> float:
    """The whole text stream in one piece (0 without one)."""
    return 0.0 if text is None else text_piece_cost(text, chunk)


def is_check(piece: dict) -> bool:
    """The prefill check or the text stream: a piece that compares no decode step of the prompts."""
    return bool(piece.get(PREFILL) or piece.get(TEXT))


def steps_of(pieces: Sequence[dict]) -> int:
    """The decode steps ``pieces`` compare (the prefill check and the text stream compare none of them)."""
    return sum(p["stop"] - p["start"] for p in pieces if not is_check(p))


def mid_prompt_starts(pieces: Sequence[dict]) -> int:
    """How many of ``pieces`` start mid-prompt (after a warm-up on the prompt's earlier tokens)."""
    return sum(1 for p in pieces if not is_check(p) and p["start"] > p["first"])


def piece_cost(piece: dict, chunk: int, prefill_tokens: int, text: tuple[int, Sequence[int]] | None = None) -> float:
    """One piece's cost in decode calls; ``text``: the text stream's (tokens, horizons), for its pieces."""
    if piece.get(PREFILL):
        return prefill_check_cost(prefill_tokens, chunk)
    if piece.get(TEXT):
        return text_piece_cost(text, chunk, piece.get("horizons"))
    return warmup_cost(piece["start"] - piece["first"], chunk) + piece["stop"] - piece["start"]


def _pack(lengths: Sequence[int], check: float, chunk: int, limit: float, aligned: bool,
          text_units: Sequence[tuple[dict, float]] = ()) -> list[list[dict]] | None:
    """Shards of cost at most ``limit``, filled in order (the prefill check first, then each
    prompt's steps; the text stream's pieces ``text_units`` (piece, cost), right after the prefill
    check, each uncut, in the current shard or a new one); None when some piece cannot fit. ``aligned``: a prompt that does not fit in
    what is left of the current shard starts a new one at its first step, and is cut only when it
    does not fit in a whole shard either (no warm-up is paid where it would not shorten anything)."""
    if check > limit + EPS:
        return None
    shards: list[list[dict]] = [[{PREFILL: True}]]
    room = limit - check
    for piece, cost in text_units:
        if cost > limit + EPS:
            return None
        if cost > room + EPS:
            shards.append([])
            room = limit
        shards[-1].append(piece)
        room -= cost
    first = 0
    for i, n in enumerate(lengths):
        offset = 0
        if aligned and room + EPS < n <= limit + EPS and shards[-1]:
            shards.append([])
            room = limit
        while offset < n:
            fresh = not shards[-1]
            warm = warmup_cost(offset, chunk) if fresh and offset else 0.0
            take = min(n - offset, math.floor(room - warm + EPS))
            if take <= 0:
                if fresh:
                    return None  # the warm-up alone exceeds the limit
                shards.append([])
                room = limit
                continue
            shards[-1].append({"prompt": i, "first": first, "start": first + offset, "stop": first + offset + take})
            room -= warm + take
            offset += take
        first += n
    return [s for s in shards if s]


def _best(lengths, check, chunk, shards: int, aligned: bool, text_units=()) -> tuple[float, list[list[dict]]]:
    """The smallest limit whose packing needs at most ``shards`` shards, and that packing."""
    lo, hi = 0.0, check + sum(c for _, c in text_units) + sum(lengths) + 1.0  # one shard holds everything at hi
    best = _pack(lengths, check, chunk, hi, aligned, text_units)
    for _ in range(60):
        mid = (lo + hi) / 2
        packed = _pack(lengths, check, chunk, mid, aligned, text_units)
        if packed is not None and len(packed) <= shards:
            hi, best = mid, packed
        else:
            lo = mid
    return hi, best


def _cost(shard: list[dict], chunk: int, prefill_tokens: int, text=None) -> float:
    return sum(piece_cost(p, chunk, prefill_tokens, text) for p in shard)


def text_units(text: tuple[int, Sequence[int]] | None, chunk: int, shards: int) -> list[tuple[dict, float]]:
    """The text stream's pieces and their costs: one piece in one shard (the whole stream once);
    with more shards a piece per horizon, each from zero states (coreai/entrypoints.text_piece), so
    that the longest shard is not the whole stream."""
    if text is None:
        return []
    if shards == 1:
        return [({TEXT: True}, text_piece_cost(text, chunk))]
    return [({TEXT: True, "horizons": [k]}, text_piece_cost(text, chunk, [k])) for k in range(len(text[1]))]


def plan(lengths: Sequence[int], prefill_tokens: int, chunk: int, shards: int,
         text: tuple[int, Sequence[int]] | None = None) -> list[list[dict]]:
    """Exactly ``shards`` shards over prompts of ``lengths`` steps (in stream order), the
    prefill check of ``prefill_tokens`` tokens and the text stream of ``text`` = (tokens,
    horizons) (None: none), the longest as short as the packing finds. Where
    the best packing needs fewer shards (the stream is not the one :func:`shard_count` planned
    for), the longest is split at its last piece's middle until there are ``shards``. One shard:
    the prefill check, the text stream, then every prompt in order (the unsharded gate's order)."""
    if shards < 1:
        raise ValueError("shards must be at least 1")
    check = prefill_check_cost(prefill_tokens, chunk)
    units = text_units(text, chunk, shards)
    packed = [_best(lengths, check, chunk, shards, aligned, units) for aligned in (True, False)]
    limit_aligned, limit_greedy = packed[0][0], packed[1][0]
    out = packed[0][1] if limit_aligned <= limit_greedy + EPS else packed[1][1]
    while len(out) < shards:  # a shard with several pieces gives its last one a shard; else it is halved
        candidates = [s for s in out if len(s) > 1 or s[0].get("stop", 0) - s[0].get("start", 0) >= 2]
        if not candidates:
            raise ValueError(f"{shards} shards are more than the gate's {sum(lengths)} steps and its checks")
        longest = max(candidates, key=lambda s: _cost(s, chunk, prefill_tokens, text))
        at = out.index(longest) + 1
        if len(longest) > 1:
            out.insert(at, [longest.pop()])
        else:
            piece = longest[0]
            mid = (piece["start"] + piece["stop"]) // 2
            longest[0] = {**piece, "stop": mid}
            out.insert(at, [{**piece, "start": mid}])
    return out


def critical_cost(lengths: Sequence[int], prefill_tokens: int, chunk: int, shards: int,
                  text: tuple[int, Sequence[int]] | None = None) -> float:
    """The longest shard of :func:`plan`, in decode calls."""
    return max(_cost(s, chunk, prefill_tokens, text) for s in plan(lengths, prefill_tokens, chunk, shards, text))


def shard_count(lengths: Sequence[int], prefill_tokens: int, chunk: int, call_seconds: float | None,
                shard_seconds: float, text: tuple[int, Sequence[int]] | None = None) -> int:
    """How many shards: enough that each takes about ``shard_seconds`` at ``call_seconds`` per
    decode call (None: unknown, as for a checkpoint not yet downloaded -- as many as shorten the
    gate), but no more than shorten its longest shard (a prompt is cut only where its warm-up
    costs less than what the cut saves). One for a gate shorter than ``shard_seconds``."""
    total = prefill_check_cost(prefill_tokens, chunk) + text_check_cost(text, chunk) + sum(lengths)
    most = 1 + (0 if text is None else len(text[1])) + sum(lengths)  # each check piece and one step per shard
    wanted = most if call_seconds is None else max(1, min(most, math.ceil(total * call_seconds / shard_seconds)))
    if wanted == 1:
        return 1
    target = critical_cost(lengths, prefill_tokens, chunk, wanted, text)
    lo, hi = 1, wanted  # the fewest shards with the same longest shard
    while lo < hi:
        mid = (lo + hi) // 2
        if critical_cost(lengths, prefill_tokens, chunk, mid, text) <= target + EPS:
            hi = mid
        else:
            lo = mid + 1
    return lo
