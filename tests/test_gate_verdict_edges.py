"""The verdict math's boundaries and outputs, pinned (stages/gate_verdict.py; issue 34, the
mutation run: docs/measurements/2026-12-06-mutation.md). Each test kills mutants of ``make mutate``
that the first suite let live: a ``<`` for a ``<=`` at a threshold, a limit read under another key,
a reason without its text, a key of the verdict renamed, a relative state difference that passes a
zero scale. Exact values throughout: a boundary is tested AT the boundary."""

from __future__ import annotations

import math

import numpy as np
import pytest

from recurrent_coreai.stages import gate_verdict as gv

T = {"min_agree": 1.0, "min_counted": 0.5, "max_abs_dlogits": None}


def row(step: int, *, near_tie: bool = False, agree: bool = True, dmax: float = 0.0, kl: float = 0.0,
        top1: int = 1, top2: int = 2, engine: int | None = None, **extra) -> dict:
    return {"step": step, "ref_top1": top1, "ref_top2": top2, "engine_top1": top1 if engine is None else engine,
            "ref_margin": 0.0 if near_tie else 1.0, "near_tie": near_tie, "agree": agree, "max_abs_dlogits": dmax,
            "kl": kl, **extra}


# --- one step -----------------------------------------------------------------------------------
def test_a_step_records_every_field_exactly():
    ref = np.array([0.0, 3.0, 1.0, 2.5, -1.0])
    eng = np.array([0.25, 2.0, 1.0, 2.75, -1.0])
    r = gv.compare(ref, eng, epsilon=0.4, next_token=3)
    lp = ref - ref.max() - np.log(np.exp(ref - ref.max()).sum())
    lq = eng - eng.max() - np.log(np.exp(eng - eng.max()).sum())
    assert r == pytest.approx({"ref_top1": 1, "ref_top2": 3, "engine_top1": 3, "ref_margin": 0.5, "near_tie": False,
                               "agree": False, "max_abs_dlogits": 1.0, "kl": float(np.sum(np.exp(lp) * (lp - lq))),
                               "nll_ref": -lp[3], "nll_eng": -lq[3], "dp": np.exp(lq[3]) - np.exp(lp[3])})
    assert r["kl"] > 0


def test_a_margin_equal_to_the_epsilon_is_not_a_near_tie():
    """near-tie: margin BELOW the epsilon (docs/gate.md)."""
    ref = np.array([0.0, 1.0, 0.5, 0.0])
    assert gv.compare(ref, ref, epsilon=0.5)["near_tie"] is False
    assert gv.compare(ref, ref, epsilon=0.5000001)["near_tie"] is True


def test_large_logits_give_a_finite_log_softmax():
    """The max is subtracted before exp: logits of 1000 (a wide fp32 head) stay finite."""
    x = np.array([1000.0, 999.0, 990.0])
    lp = gv.log_softmax(x)
    assert np.isfinite(lp).all() and lp[0] == pytest.approx(-math.log(1 + math.exp(-1) + math.exp(-10)))
    r = gv.compare(x, x + 0.5, epsilon=0.1, next_token=0)
    assert r["kl"] == pytest.approx(0.0, abs=1e-12) and r["nll_ref"] == pytest.approx(-lp[0])


# --- finite logits, counted steps, agreement, near-ties ----------------------------------------
@pytest.mark.parametrize("dmax, kl", [(0.1, math.nan), (math.inf, 0.1), (0.1, math.inf)])
def test_a_row_with_either_number_not_finite_fails(dmax, kl):
    rows = [row(0), row(1, dmax=dmax, kl=kl), row(2)]
    reason = gv.nonfinite_reason(rows)
    assert reason == ("the bundle's logits are not finite (inf or NaN) at 1/3 step(s), first at step 1: its weights "
                      "or activations overflow this recipe's number format")
    assert gv.verdict(rows, T)["pass"] is False


def test_counted_exactly_at_min_counted_passes():
    rows = [row(i, near_tie=i % 2 == 1) for i in range(10)]  # 5 of 10 counted, min_counted 0.5
    assert gv.counted_reasons(rows, 0.5) == []
    assert gv.counted_reasons(rows, 0.51) == ["only 5/10 steps counted outside near-ties, fewer than min_counted 0.51 "
                                              "of them (near_tie_epsilon too large for this reference?)"]


def test_a_near_tie_that_picks_a_third_token_fails_at_min_agree_one_only():
    rows = [row(0), row(1), row(2, near_tie=True, agree=False, engine=7), row(3, near_tie=True, agree=False, engine=2)]
    v = gv.verdict(rows, {**T, "min_agree": 1.0})
    assert v["pass"] is False and v["reasons"] == ["1 near-tie step(s) picked neither of the reference's top 2"]
    assert v["near_ties_in_top2"] == 1
    assert gv.verdict(rows, {**T, "min_agree": 0.99})["pass"] is True


def test_the_max_abs_dlogits_limit_is_read_and_equal_passes():
    rows = [row(0, dmax=0.5), row(1, dmax=2.0), row(2, dmax=1.0)]
    assert gv.verdict(rows, {**T, "max_abs_dlogits": 2.0})["pass"] is True  # at the limit
    v = gv.verdict(rows, {**T, "max_abs_dlogits": 1.5})
    assert v["pass"] is False and v["reasons"] == ["max|dlogits| 2 exceeds 1.5"]
    nan = gv.verdict([row(0, dmax=math.nan, kl=0.0)], {**T, "max_abs_dlogits": 1e9})
    assert "max|dlogits| nan exceeds 1e+09" in nan["reasons"]


def test_the_verdict_states_every_count_under_its_key():
    rows = [row(0, kl=0.2), row(1, agree=False, engine=5, kl=0.4, dmax=3.0), row(2, near_tie=True, kl=0.0),
            row(3, near_tie=True, agree=False, engine=2, kl=0.6), row(4, kl=0.3)]
    v = gv.verdict(rows, {**T, "min_agree": 0.5})
    expect = {"steps": 5, "agree": 3, "counted": 3, "agree_counted": 2, "near_ties": 2, "near_ties_in_top2": 2,
              "mismatches": 1, "max_abs_dlogits": 3.0, "pass": True, "reasons": []}
    assert {k: v[k] for k in expect} == expect
    assert v["agree_rate"] == pytest.approx(2 / 3) and v["mean_kl"] == pytest.approx(0.3)


# --- quality ------------------------------------------------------------------------------------
NONE = {"kld_mean": None, "kld_median": None, "kld_p99": None, "kld_max": None, "same_top1": None, "scored": 0,
        "rms_dp": None, "ppl_ref": None, "ppl_bundle": None, "ppl_ratio": None}


def test_quality_of_no_rows_is_none_and_of_one_row_is_that_row():
    assert gv.quality([]) == NONE
    one = gv.quality([row(0, kl=0.25)])
    assert {k: one[k] for k in ("kld_mean", "kld_median", "kld_p99", "kld_max", "same_top1")} == {
        "kld_mean": 0.25, "kld_median": 0.25, "kld_p99": 0.25, "kld_max": 0.25, "same_top1": 1.0}
    assert {k: one[k] for k in ("scored", "rms_dp", "ppl_ref", "ppl_bundle", "ppl_ratio")} == {
        "scored": 0, "rms_dp": None, "ppl_ref": None, "ppl_bundle": None, "ppl_ratio": None}


@pytest.mark.parametrize("key, stat, kind", [(k, *v) for k, v in gv.QUALITY_LIMITS.items()])
def test_each_quality_limit_alone_is_read_and_equal_passes(key, stat, kind):
    """Each limit set alone (the others absent) is judged; a value equal to the limit passes; the
    reason says above or below as the limit's kind is."""
    rows = [row(i, kl=0.5, agree=i != 0, nll_ref=1.0, nll_eng=1.5, dp=0.1) for i in range(4)]
    stats = gv.quality(rows)
    value = stats[stat]
    assert value > 0 and gv.quality_reasons(stats, {key: value}) == []  # at the limit
    broken = value / 2 if kind == "max" else value * 1.25
    side = "above" if kind == "max" else "below"
    assert gv.quality_reasons(stats, {key: broken}) == [f"{stat} {value:.4g} is {side} {key} {broken:g}"]


# --- the prefill check's states -----------------------------------------------------------------
def test_state_differences_are_the_largest_absolute_difference():
    eng = {"s": np.array([1.0, -2.0, 3.0], np.float32), "t": np.zeros(2)}
    ref = {"s": np.array([1.5, -2.0, 2.0], np.float32), "t": np.zeros(2)}
    assert gv.state_diffs(eng, ref) == {"s": 1.0, "t": 0.0}
    assert gv.state_scales(ref) == {"s": 2.0, "t": 0.0}
    nan = gv.state_diffs({"s": np.array([1.0, np.nan]), "t": np.zeros(2)}, {"s": np.ones(2), "t": np.zeros(2)})
    assert math.isnan(nan["s"]) and nan["t"] == 0.0


@pytest.mark.parametrize("d, scale, want", [(1.0, 0.5, 2.0), (0.25, 2.0, 0.125), (0.0, 0.0, 0.0), (0.1, 0.0, math.inf),
                                            (math.nan, 1.0, math.nan), (0.0, math.nan, math.nan),
                                            (math.nan, 0.0, math.nan)])
def test_relative_state_differences(d, scale, want):
    got = gv.relative_diffs({"s": d}, {"s": scale})["s"]
    assert isinstance(got, float)
    assert (math.isnan(got) and math.isnan(want)) or got == want


def test_the_worst_is_the_largest_with_nan_above_any_number():
    assert gv.worst([(0.5, "a"), (2.0, "b"), (1.0, "c")]) == (2.0, "b")
    found = gv.worst([(0.5, "z"), (math.nan, "a"), (3.0, "b")])
    assert math.isnan(found[0]) and found[1] == "a"


def test_the_logit_scale_is_the_median_of_each_steps_range():
    logits = np.array([[0.0, 1.0, 2.0], [10.0, 10.5, 11.0], [-5.0, 0.0, 5.0]], np.float32)
    assert gv.logit_scale(logits) == 2.0  # ranges 2, 1, 10


def test_every_limit_on_a_statistic_nothing_scored_is_named():
    """Two limits set on statistics no step gave: both are reasons, not only the first."""
    assert gv.quality_reasons(gv.quality([]), {"max_kld_mean": 1.0, "max_ppl_ratio": 2.0}) == [
        "max_kld_mean is set, but the gate scored no step for kld_mean",
        "max_ppl_ratio is set, but the gate scored no step for ppl_ratio"]


# --- the text stream (horizon_table, drift_reasons, text_verdict) -----------------------------------
def _text_rows(positions, kl=0.1, agree=True, near_tie=False):
    return [row(p, kl=kl, agree=agree, near_tie=near_tie, pos=p) for p in positions]


def test_a_horizon_scores_exactly_the_chunk_before_it_and_names_every_field():
    rows = _text_rows(range(0, 9))            # positions 0..8; horizon 8, chunk 4: positions 4..7
    rows[7]["kl"], rows[8]["kl"] = 0.5, 9.0   # position 8 is past the horizon: not in its chunk
    states = {8: {"a": {"max_abs_dstate": 0.2, "max_rel_dstate": 0.01, "scale": 20.0},
                  "b": {"max_abs_dstate": 0.1, "max_rel_dstate": 0.05, "scale": 2.0}}}
    (h,) = gv.horizon_table(rows, states, [8], 4)
    assert h == {"horizon": 8, "positions": 4, "kld_mean": pytest.approx((0.1 * 3 + 0.5) / 4), "kld_max": 0.5,
                 "same_top1": 1.0, "state": "b", "max_rel_dstate": 0.05, "max_abs_dstate": 0.1,
                 "states": states[8]}


def test_a_horizon_with_nothing_scored_or_compared_has_none():
    (h,) = gv.horizon_table([], {}, [8], 4)
    assert h == {"horizon": 8, "positions": 0, "kld_mean": None, "kld_max": None, "same_top1": None, "state": None,
                 "max_rel_dstate": None, "max_abs_dstate": None, "states": {}}


def test_the_worst_state_at_a_horizon_is_nan_above_any_number():
    states = {4: {"a": {"max_abs_dstate": 1.0, "max_rel_dstate": 0.9, "scale": 1.0},
                  "n": {"max_abs_dstate": math.nan, "max_rel_dstate": math.nan, "scale": 1.0},
                  "z": {"max_abs_dstate": 0.1, "max_rel_dstate": 0.1, "scale": 1.0}}}
    (h,) = gv.horizon_table(_text_rows(range(4)), states, [4], 4)
    assert h["state"] == "n" and math.isnan(h["max_rel_dstate"])


def test_a_state_drift_equal_to_the_limit_passes():
    table = [{"horizon": 8, "state": "s", "max_rel_dstate": 0.05}]
    assert gv.drift_reasons(table, 0.05) == []
    assert gv.drift_reasons(table, 0.04) == ["state s after 8 tokens of text differs from the reference's by 0.05 of "
                                             "its largest magnitude > text_max_rel_dstate 0.04"]


def test_the_text_streams_near_ties_are_counted_with_the_gates_other_rows():
    """Every text row a near-tie: not a reason of the text verdict itself (counted_over=[]); the
    gate counts them with its decode and prefill rows."""
    rows = _text_rows(range(8), near_tie=True)
    v = gv.text_verdict(rows, {8: {"s": {"max_abs_dstate": 0.0, "max_rel_dstate": 0.0, "scale": 1.0}}}, [8], 8,
                        {"min_agree": 1.0, "min_counted": 0.8, "max_abs_dlogits": None, "text_max_rel_dstate": 0.1})
    assert v["pass"] is True and v["reasons"] == [], v["reasons"]
