"""The gate's verdict math, pure: rows of compared logits in, numbers and a verdict out.

Nothing here runs a bundle or reads a file, so every rule that decides pass or fail can be
tested on made-up rows and mutation-tested (``make mutate``). :mod:`stages.gate` runs the
bundle and calls these; :mod:`stages.derivation` recomputes the same verdict from the gate's TSV.

The rules, each stated once:

* **a step** (:func:`compare`): the reference's top-1 and top-2, the bundle's top-1, the
  reference's top-2 margin, near-tie (margin below the near-tie epsilon), agreement, max|Δlogits|,
  KL(reference ‖ bundle), and where the stream's next token is known, each side's negative
  log-likelihood of it and the bundle's probability of it minus the reference's (Δp);
* **the near-tie epsilon** (:func:`epsilon_used`): the configured ``near_tie_epsilon``, at most
  ``MAX_EPSILON_SHARE`` of the reference's logit scale (the median over its decode steps of max -
  min logit), so one constant works for random weights' wide logits and trained models' narrow
  ones;
* **counted steps** (:func:`counted_reasons`): too few steps outside near-ties fails the gate, judged
  over every compared row of the gate together (decode steps and the prefill check), so that a
  section of a few rows cannot fail a correct conversion on near-ties alone;
* **finite logits**: a bundle whose logits hold inf or NaN at any step fails, whatever the
  thresholds;
* **quality** (:func:`quality`): what users quote for a quantised model -- KL divergence mean,
  median, p99 and max; same top-1 share; RMS Δp; the reference's and the bundle's perplexity of
  the stream and their ratio -- with optional per-recipe limits (``QUALITY_LIMITS``);
* **the text stream** (:func:`text_verdict`): the long held-out text's rows judged like decode rows
  (their counted rows join the gate's ``min_counted`` pool), plus at each horizon the KL and top-1
  of the scored chunk before it and every state's difference from the reference's, relative to the
  state's own largest magnitude (``text_max_rel_dstate`` where a recipe sets it).
"""

from __future__ import annotations

import math

import numpy as np

# near_tie_epsilon may be at most this share of the reference's logit scale: the median over its
# decode steps of (largest - smallest logit). The default models' scale is 33.4 (gdn-tiny) to
# 59.2 (rwkv7-tiny), so the configured 0.1 is in force there; a trained byte-level model's scale
# of ~5 makes it ~0.1 as well (docs/gate.md).
MAX_EPSILON_SHARE = 0.02

# Optional per-recipe limits in the terms users quote (config gate/thresholds/<recipe>): key ->
# (the quality statistic it bounds, "max" or "min")
QUALITY_LIMITS = {
    "max_kld_mean": ("kld_mean", "max"),
    "max_kld_p99": ("kld_p99", "max"),
    "min_same_top1": ("same_top1", "min"),
    "max_ppl_ratio": ("ppl_ratio", "max"),
}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def top_two(logits: np.ndarray) -> tuple[int, int]:
    """The indices of the largest and the second largest logit, in linear time (an exact tie at
    the top: the lower index first)."""
    first = int(np.argmax(logits))
    rest = logits.copy()
    rest[first] = -np.inf
    return first, int(np.argmax(rest))


def compare(ref_logits: np.ndarray, eng_logits: np.ndarray, epsilon: float, next_token: int | None = None) -> dict:
    """Per-step comparison of two logit vectors (float64). ``next_token``: the stream's next token
    where known (its NLL under each side and Δp; NaN otherwise)."""
    top2 = top_two(ref_logits)
    margin = float(ref_logits[top2[0]] - ref_logits[top2[1]])
    eng = int(np.argmax(eng_logits))
    with np.errstate(invalid="ignore", over="ignore"):
        lp, lq = log_softmax(ref_logits), log_softmax(eng_logits)
        kl = float(np.sum(np.exp(lp) * (lp - lq)))
        dmax = float(np.abs(ref_logits - eng_logits).max())
    if not np.isfinite(eng_logits).all():  # an inf logit makes lq NaN; say inf or NaN plainly
        dmax = kl = float("nan") if np.isnan(eng_logits).any() else float("inf")
    row = {"ref_top1": int(top2[0]), "ref_top2": int(top2[1]), "engine_top1": eng, "ref_margin": margin,
           "near_tie": margin < epsilon, "agree": eng == int(top2[0]), "max_abs_dlogits": dmax, "kl": kl}
    if next_token is not None:
        with np.errstate(invalid="ignore", over="ignore"):
            row.update(nll_ref=float(-lp[next_token]), nll_eng=float(-lq[next_token]),
                       dp=float(np.exp(lq[next_token]) - np.exp(lp[next_token])))
    return row


def _largest(values) -> float:
    """The largest value, NaN above any number (max() would keep whichever came first)."""
    values = list(values)
    if any(math.isnan(v) for v in values):
        return float("nan")
    return max(values)


def nonfinite_reason(rows: list[dict]) -> str | None:
    """A reason when the bundle's logits held inf or NaN at some step (its max|Δlogits| or KL is
    not finite: the reference's are checked finite by the reference stage)."""
    bad = [r for r in rows if not (math.isfinite(r["max_abs_dlogits"]) and math.isfinite(r["kl"]))]
    if not bad:
        return None
    return (f"the bundle's logits are not finite (inf or NaN) at {len(bad)}/{len(rows)} step(s), first at step "
            f"{bad[0]['step']}: its weights or activations overflow this recipe's number format")


def counted_reasons(rows: list[dict], min_counted: float, what: str = "steps") -> list[str]:
    """Too few ``rows`` counted outside near-ties: none at all, or fewer than ``min_counted`` of
    them. ``rows``: every compared row the rule is judged over (decode and prefill together)."""
    if not rows:
        return []
    counted = sum(not r["near_tie"] for r in rows)
    if not counted:
        return [f"0/{len(rows)} {what} counted: every step is a near-tie (reference top-2 margin below "
                "near_tie_epsilon), so no top-1 pick was compared"]
    if counted < min_counted * len(rows):
        return [f"only {counted}/{len(rows)} {what} counted outside near-ties, fewer than min_counted "
                f"{min_counted:g} of them (near_tie_epsilon too large for this reference?)"]
    return []


def quality(rows: list[dict]) -> dict:
    """The statistics users quote for a quantised model, over ``rows`` (llama.cpp's
    ``perplexity --kl-divergence`` report): KL(reference ‖ bundle) mean, median, p99 and max; the
    share of steps whose top-1 is the reference's; RMS Δp and both perplexities (over the steps
    whose next token the stream holds: ``scored``) and their ratio. None where nothing was scored."""
    kl = np.array([r["kl"] for r in rows], np.float64)
    scored = [r for r in rows if not math.isnan(r.get("nll_ref", float("nan")))]
    some = len(kl) > 0
    out = {"kld_mean": float(np.mean(kl)) if some else None,
           "kld_median": float(np.median(kl)) if some else None,
           "kld_p99": float(np.percentile(kl, 99)) if some else None,
           "kld_max": _largest(kl.tolist()) if some else None,
           "same_top1": float(np.mean([r["agree"] for r in rows])) if some else None,
           "scored": len(scored), "rms_dp": None, "ppl_ref": None, "ppl_bundle": None, "ppl_ratio": None}
    if scored:
        nll_ref = np.array([r["nll_ref"] for r in scored], np.float64)
        nll_eng = np.array([r["nll_eng"] for r in scored], np.float64)
        dp = np.array([r["dp"] for r in scored], np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            out.update(rms_dp=float(np.sqrt(np.mean(dp ** 2))), ppl_ref=float(np.exp(np.mean(nll_ref))),
                       ppl_bundle=float(np.exp(np.mean(nll_eng))),
                       ppl_ratio=float(np.exp(np.mean(nll_eng) - np.mean(nll_ref))))
    return out


def quality_reasons(stats: dict, thresholds: dict) -> list[str]:
    """The recipe's optional quality limits (``QUALITY_LIMITS``) the statistics break (NaN breaks any)."""
    reasons = []
    for key, (stat, kind) in QUALITY_LIMITS.items():
        limit = thresholds.get(key)
        if limit is None:
            continue
        value = stats[stat]
        if value is None:
            reasons.append(f"{key} is set, but the gate scored no step for {stat}")
            continue
        ok = value <= limit if kind == "max" else value >= limit  # NaN: False
        if not ok:
            reasons.append(f"{stat} {value:.4g} is {'above' if kind == 'max' else 'below'} {key} {limit:g}")
    return reasons


def verdict(rows: list[dict], thresholds: dict, counted_over: list[dict] | None = None) -> dict:
    """The verdict on compared steps (decode rows or the prefill check's): a pure function of
    the rows and the recipe's thresholds, so that it can be recomputed from the gate's TSV.
    Top-1 agreement is judged on the counted steps (not near-ties) only; too few counted steps
    fails (:func:`counted_reasons`), judged over ``counted_over`` (default: ``rows``; an empty list:
    judged elsewhere, e.g. the prefill check, whose rows the gate counts with its decode rows)."""
    counted = [r for r in rows if not r["near_tie"]]
    ties = [r for r in rows if r["near_tie"]]
    agree = sum(r["agree"] for r in counted)
    tie_ok = sum(r["engine_top1"] in (r["ref_top1"], r["ref_top2"]) for r in ties)
    agree_rate = agree / len(counted) if counted else 0.0  # nothing counted: no agreement was shown
    max_abs = _largest(r["max_abs_dlogits"] for r in rows)
    min_counted = thresholds["min_counted"]
    reasons = counted_reasons(rows if counted_over is None else counted_over, min_counted)
    bad = nonfinite_reason(rows)
    if bad:
        reasons.append(bad)
    if counted and agree_rate < thresholds["min_agree"]:
        reasons.append(f"top-1 agreement {agree}/{len(counted)} outside near-ties is below {thresholds['min_agree']}")
    if thresholds["min_agree"] >= 1.0 and tie_ok < len(ties):
        reasons.append(f"{len(ties) - tie_ok} near-tie step(s) picked neither of the reference's top 2")
    limit = thresholds.get("max_abs_dlogits")
    if limit is not None and not max_abs <= limit:  # NaN fails too
        reasons.append(f"max|dlogits| {max_abs:.3g} exceeds {limit:g}")
    stats = quality(rows)
    reasons += quality_reasons(stats, thresholds)
    return {
        "steps": len(rows), "agree": sum(r["agree"] for r in rows), "counted": len(counted),
        "agree_counted": agree, "agree_rate": agree_rate, "near_ties": len(ties),
        "near_ties_in_top2": tie_ok, "mismatches": len(counted) - agree,
        "max_abs_dlogits": max_abs, "mean_kl": float(np.mean([r["kl"] for r in rows])),
        **stats, "pass": not reasons, "reasons": reasons,
    }


def logit_scale(logits: np.ndarray) -> float:
    """The reference's logit scale: the median over its decode steps of max - min logit."""
    return float(np.median(logits.max(axis=1).astype(np.float64) - logits.min(axis=1)))


def epsilon_used(configured: float, scale: float) -> float:
    """The near-tie epsilon the gate uses: the configured one, at most MAX_EPSILON_SHARE of the
    reference's logit scale (a larger one would make most steps of a narrow-logit model near-ties,
    whose top-1 pick the gate does not check)."""
    return float(min(configured, MAX_EPSILON_SHARE * scale))


def state_diffs(engine: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> dict[str, float]:
    """max|engine - reference| per state (NaN if the engine's state holds a NaN)."""
    out = {}
    for name, ref in reference.items():
        d = np.abs(engine[name].astype(np.float64) - ref.astype(np.float64))
        out[name] = float("nan") if np.isnan(d).any() else float(d.max())
    return out


def state_scales(reference: dict[str, np.ndarray]) -> dict[str, float]:
    """max|reference state| per state: the scale its differences are judged on."""
    return {name: float(np.abs(ref.astype(np.float64)).max()) for name, ref in reference.items()}


def relative_diffs(diffs: dict[str, float], scales: dict[str, float]) -> dict[str, float]:
    """Each state's max|Δ| (:func:`state_diffs`) over its max|reference state| (:func:`state_scales`).
    A state the reference holds at zero: 0 if the engine's is zero too, else inf; NaN stays NaN
    (both fail any limit)."""
    out = {}
    for name, d in diffs.items():
        scale = scales[name]
        if np.isnan(d) or np.isnan(scale):
            out[name] = float("nan")
        elif scale > 0:
            out[name] = d / scale
        else:
            out[name] = 0.0 if d == 0 else float("inf")
    return out


def worst(found: list[tuple]) -> tuple:
    """The largest of (value, ...) tuples, a NaN above any number."""
    return max(found, key=lambda d: (np.isnan(d[0]), d[0]))


def horizon_table(rows: list[dict], states: dict[int, dict], horizons: list[int], chunk: int) -> list[dict]:
    """Per horizon ``h``: the rows of the scored chunk before it (positions ``h - chunk`` .. ``h - 1``):
    their count, mean and max KL, same top-1 share; and the states compared at ``h`` (``states[h]``:
    name -> max_abs_dstate, max_rel_dstate, scale): every state's numbers and the worst by its
    relative difference (NaN worst). A horizon with no compared states has None there."""
    table = []
    for h in horizons:
        window = [r for r in rows if h - chunk <= r["pos"] < h]
        kl = [r["kl"] for r in window]
        named = states.get(h) or {}
        worst_name = max(named, key=lambda n: (math.isnan(named[n]["max_rel_dstate"]), named[n]["max_rel_dstate"]),
                         default=None)
        table.append({"horizon": h, "positions": len(window),
                      "kld_mean": float(np.mean(kl)) if kl else None, "kld_max": _largest(kl) if kl else None,
                      "same_top1": float(np.mean([r["agree"] for r in window])) if window else None,
                      "state": worst_name,
                      "max_rel_dstate": named[worst_name]["max_rel_dstate"] if worst_name else None,
                      "max_abs_dstate": named[worst_name]["max_abs_dstate"] if worst_name else None,
                      "states": named})
    return table


def drift_reasons(table: list[dict], limit: float | None) -> list[str]:
    """A reason per horizon whose worst relative state difference breaks ``limit`` (None: not
    checked; NaN breaks it), and one where a horizon compared no state at all."""
    if limit is None:
        return []
    reasons = []
    for h in table:
        rel = h["max_rel_dstate"]
        if rel is None:
            reasons.append(f"no state was compared at horizon {h['horizon']}")
        elif not rel <= limit:
            reasons.append(f"state {h['state']} after {h['horizon']} tokens of text differs from the reference's by "
                           f"{rel:.3g} of its largest magnitude > text_max_rel_dstate {limit:g}")
    return reasons


def text_verdict(rows: list[dict], states: dict[int, dict], horizons: list[int], chunk: int,
                 thresholds: dict) -> dict:
    """The text stream's verdict: :func:`verdict` on its rows (counted with the gate's other rows,
    so ``counted_over=[]`` here), its :func:`horizon_table` and :func:`drift_reasons`."""
    result = verdict(rows, thresholds, counted_over=[])
    result["horizons"] = horizon_table(rows, states, horizons, chunk)
    result["reasons"] = result["reasons"] + drift_reasons(result["horizons"], thresholds.get("text_max_rel_dstate"))
    result["pass"] = not result["reasons"]
    return result
