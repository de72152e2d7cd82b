"""The gate's long held-out text stream (gate/text; docs/gate.md#the-text-stream): how it runs
through a bundle, how it splits across shards, what it judges, and its one-line refusals.

A toy recurrence stands in for the model: the reference (stages/reference.text_stream) and a fake
runtime session run the same math, so the gate's text check must find them equal -- and must find
the state drift and the flipped tokens of a session that goes wrong only late in the stream.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recurrent_coreai.coreai.entrypoints import DECODE, PREFILL, text_logit_positions, text_piece, text_plan
from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.pipeline import shards
from recurrent_coreai.stages import gate, gate_verdict, reference
from recurrent_coreai.util.errors import PipelineError

VOCAB, DIM, CHUNK = 11, 4, 8
HORIZONS = [16, 40, 64]
N = 68  # a tail of 4 past the last horizon


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(VOCAB, DIM)), rng.normal(size=(DIM, VOCAB)) * 3


class ToyRef:
    """The reference's interface (zero_state, advance, logits, bundle_states): s = 0.9 s + E[token];
    logits = s W."""

    def __init__(self):
        self.emb, self.head = _weights()

    def zero_state(self):
        return {"s": np.zeros(DIM)}

    def advance(self, tok, state):
        state["s"] = 0.9 * state["s"] + self.emb[tok]
        return state["s"].copy()

    def logits(self, x):
        return torch.tensor(x @ self.head, dtype=torch.float64)

    def bundle_states(self, state):
        return {"toyState": state["s"].astype(np.float32)}


class ToySession:
    """The runtime session's interface the text check drives; ``drift_after``: from that position on
    every call adds ``drift`` to the state (a recurrence that goes wrong only over long contexts)."""

    chunk, function, prefill_function, aimodelx = CHUNK, "main", "prefill", "toy.aimodelx"

    def __init__(self, drift_after=None, drift=0.0):
        self.emb, self.head = _weights()
        self.drift_after, self.drift = drift_after, drift
        self.calls = []
        self.reset()

    def reset(self):
        self.s, self.pos = np.zeros(DIM), 0

    def _one(self, tok):
        self.s = 0.9 * self.s + self.emb[tok]
        if self.drift_after is not None and self.pos >= self.drift_after:
            self.s = self.s + self.drift
        self.pos += 1
        return (self.s @ self.head).astype(np.float32)

    def step(self, tok):
        self.calls.append(("main", self.pos))
        return self._one(tok)

    def prefill_chunk(self, tokens):
        assert len(tokens) == CHUNK
        self.calls.append(("prefill", self.pos))
        for t in tokens:
            out = self._one(t)
        return out

    def state_arrays(self):
        return {"toyState": self.s.astype(np.float32)}


def _stream():
    tokens = np.random.default_rng(1).integers(0, VOCAB, N)
    return reference.text_stream(ToyRef(), tokens, CHUNK, HORIZONS)


def _judge(parts, thresholds):
    return gate.text_result(parts, HORIZONS, thresholds)


THRESHOLDS = {"min_agree": 1.0, "min_counted": 0.5, "max_abs_dlogits": None, "prefill_max_rel_dstate": None}


# --- how the stream runs -------------------------------------------------------------------------

def test_the_plan_runs_each_horizons_chunk_through_main_and_the_rest_through_prefill():
    runs = text_plan(N, CHUNK, HORIZONS)
    assert runs[0] == (PREFILL, 0, 8) and (DECODE, 8, 16) in runs and (DECODE, 32, 40) in runs
    assert runs[-1] == (DECODE, 64, 68)  # the tail shorter than a chunk
    assert [a for _, a, _ in runs] == [0] + [b for _, _, b in runs[:-1]]  # contiguous, from 0 to N
    pos = text_logit_positions(N, CHUNK, HORIZONS)
    assert pos[:9] == [7, *range(8, 16)] and len(pos) == len(set(pos))


def test_the_pieces_together_report_each_position_of_the_whole_plan_once():
    whole = text_logit_positions(N, CHUNK, HORIZONS)
    reported = []
    for k in range(len(HORIZONS)):
        runs, first, mine = text_piece(N, CHUNK, HORIZONS, [k])
        assert mine == [HORIZONS[k]]
        for fn, a, b in runs:
            reported += [q for q in (range(a, b) if fn == DECODE else [b - 1]) if q >= first]
    assert sorted(reported) == whole


def test_a_split_stream_judges_the_same_positions_and_horizons_and_a_true_session_passes_both_ways():
    stream = _stream()
    whole = _judge([gate.text_check(ToySession(), stream, 0.01)], THRESHOLDS)
    split = _judge([gate.text_check(ToySession(), stream, 0.01, [k]) for k in range(3)], THRESHOLDS)
    assert [r["pos"] for r in whole["rows"]] == [r["pos"] for r in split["rows"]] == text_logit_positions(N, CHUNK, HORIZONS)
    assert whole["pass"] and split["pass"], (whole["reasons"], split["reasons"])
    assert [h["horizon"] for h in whole["horizons"]] == HORIZONS
    assert all(h["max_rel_dstate"] < 1e-6 for h in whole["horizons"] + split["horizons"])
    assert whole["scored"] == len(whole["rows"]) - 1  # the last position has no next token
    assert whole["ppl_ratio"] == pytest.approx(1.0, abs=1e-5)


def test_the_shard_plan_gives_the_text_a_piece_per_horizon_only_when_it_shards():
    text = (2048, [128, 512, 1024, 2048])
    (one,) = shards.plan([32, 32, 32, 31], 133, 64, 1, text)
    assert one[:2] == [{shards.PREFILL: True}, {shards.TEXT: True}]
    many = shards.plan([32, 32, 32, 31], 133, 64, 4, text)
    pieces = [p for s in many for p in s if p.get(shards.TEXT)]
    assert sorted(p["horizons"] for p in pieces) == [[0], [1], [2], [3]]
    assert shards.steps_of([p for s in many for p in s]) == 127
    # the whole stream costs its prefill calls and its main calls once
    assert shards.text_check_cost(text, 64) == pytest.approx(28 * shards.prefill_call_cost(64) + 4 * 64)


# --- what it catches -----------------------------------------------------------------------------

def test_drift_late_in_the_stream_shows_at_the_late_horizons_and_fails_a_set_limit():
    stream = _stream()
    drifting = ToySession(drift_after=44, drift=0.05)
    res = _judge([gate.text_check(drifting, stream, 0.01)], {**THRESHOLDS, "text_max_rel_dstate": 0.01})
    early, late = res["horizons"][0], res["horizons"][-1]
    assert early["max_rel_dstate"] < 1e-6 and late["max_rel_dstate"] > 0.01
    assert not res["pass"] and any("after 64 tokens of text" in r for r in res["reasons"]), res["reasons"]
    # without a limit the drift is shown, not judged (a late token flip still fails min_agree)
    shown = _judge([gate.text_check(ToySession(drift_after=44, drift=0.05), stream, 0.01)], THRESHOLDS)
    assert shown["horizons"][-1]["max_rel_dstate"] == late["max_rel_dstate"]


def test_a_session_whose_late_logits_flip_fails_top1_and_its_perplexity_ratio_shows_it():
    stream = _stream()
    res = _judge([gate.text_check(ToySession(drift_after=44, drift=2.0), stream, 0.01)], THRESHOLDS)
    assert not res["pass"] and any("top-1 agreement" in r for r in res["reasons"])
    assert res["ppl_ratio"] > 1.05 and res["horizons"][0]["same_top1"] == 1.0 > res["horizons"][-1]["same_top1"]


def test_horizon_table_and_drift_reasons_are_pure_and_nan_fails():
    rows = [{"pos": p, "kl": 0.1 * p, "agree": p != 7} for p in range(8)]
    states = {8: {"a": {"max_abs_dstate": 1.0, "max_rel_dstate": 0.2, "scale": 5.0},
                  "b": {"max_abs_dstate": float("nan"), "max_rel_dstate": float("nan"), "scale": 1.0}}}
    (h,) = gate_verdict.horizon_table(rows, states, [8], 4)
    assert h["positions"] == 4 and h["kld_mean"] == pytest.approx(0.55) and h["same_top1"] == 0.75
    assert h["state"] == "b" and np.isnan(h["max_rel_dstate"])
    assert gate_verdict.drift_reasons([h], None) == []
    assert len(gate_verdict.drift_reasons([h], 0.5)) == 1
    (bare,) = gate_verdict.horizon_table(rows, {}, [8], 4)
    assert bare["state"] is None and gate_verdict.drift_reasons([bare], 0.5) == ["no state was compared at horizon 8"]


# --- one-line refusals ---------------------------------------------------------------------------

@pytest.mark.parametrize("horizons, what", [([16, 8], "not in ascending order"), ([12], "not a multiple"),
                                            ([72], "beyond gate.text.tokens")])
def test_bad_horizons_are_one_line(horizons, what):
    with pytest.raises(PipelineError, match=what) as err:
        cfgmod.text_settings({"text": {"file": "t.txt", "tokens": 64, "horizons": horizons}}, CHUNK, "config.yaml")
    assert "\n" not in str(err.value) and "config.yaml" in str(err.value)


class Bytes:
    def prompt(self, text, chat=True):
        return list(text.encode())


def test_the_text_file_missing_not_utf8_or_too_short_is_one_line(tmp_path):
    good = tmp_path / "t.txt"
    good.write_text("x" * 100)
    assert len(reference.text_tokens(Bytes(), {"file": str(good), "tokens": 64})) == 64
    for body, what in ((None, "is missing"), (b"\xff\xfe", "is not UTF-8"), (b"short", "fewer than gate.text.tokens")):
        path = tmp_path / "bad.txt"
        path.unlink(missing_ok=True)
        if body is not None:
            path.write_bytes(body)
        with pytest.raises(PipelineError, match=what) as err:
            reference.text_tokens(Bytes(), {"file": str(path), "tokens": 64})
        assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_reference_without_the_configured_text_stream_is_refused(tmp_path):
    stream = _stream()
    gate.check_text_stream(stream, tmp_path / "stream.npz", {"tokens": N, "horizons": HORIZONS})
    with pytest.raises(PipelineError, match="rerun the reference stage"):
        gate.check_text_stream(stream, tmp_path / "stream.npz", {"tokens": 2048, "horizons": [128]})
    bare = {k: v for k, v in stream.items() if not k.startswith("text_")}
    with pytest.raises(PipelineError, match="holds no text stream"):
        gate.check_text_stream(bare, tmp_path / "stream.npz", {"tokens": N, "horizons": HORIZONS})


def test_top_two_is_the_sorted_order_s_top_two_and_takes_the_lower_index_on_an_exact_tie():
    """compare's top-2 in linear time (issue 37: argsort of a 65536-logit row was a third of a
    World-vocabulary gate's comparison time): the same picks as a full sort where values differ."""
    for seed in range(50):
        x = np.random.default_rng(seed).normal(size=4096)
        assert gate_verdict.top_two(x) == tuple(int(i) for i in np.argsort(x)[-2:][::-1])
    assert gate_verdict.top_two(np.array([1.0, 3.0, 2.0, 3.0])) == (1, 3)
    assert gate_verdict.top_two(np.array([5.0, 1.0])) == (0, 1)
