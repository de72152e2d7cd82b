"""The gate's verdict math (stages/gate_verdict.py) on made-up rows: the rules of issue 39 (trained
weights) and issue 34 item 1 (a bundle whose logits are inf passed its gate).

* a bundle whose logits hold inf or NaN fails, whatever the thresholds (fp16 has no max|dlogits|);
* the quality statistics are the ones users quote (llama.cpp's KLD report), computed exactly;
* per-recipe quality limits fail the gate when broken, and a limit on a statistic nothing scored fails;
* the steps follow the prompts' tokens under the model's tokenizer: 256-, 566- and 768-id
  vocabularies' prompts fit the default gate with no config edit;
* a correct conversion cannot fail on near-ties alone: near-tie rows are counted over the whole gate.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from recurrent_coreai.pipeline import config
from recurrent_coreai.stages import gate_verdict as gv

THRESHOLDS = {"min_agree": 1.0, "min_counted": 0.8, "max_abs_dlogits": None, "prefill_max_rel_dstate": 0.01}


def step_rows(ref: np.ndarray, eng: np.ndarray, tokens: list[int], eps: float = 0.1) -> list[dict]:
    rows = []
    for i in range(len(ref)):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        row = {"step": i, **gv.compare(ref[i].astype(np.float64), eng[i].astype(np.float64), eps, nxt)}
        rows.append({"nll_ref": math.nan, "nll_eng": math.nan, "dp": math.nan, **row})
    return rows


def test_a_bundle_with_infinite_logits_fails_even_without_a_dlogits_limit():
    rng = np.random.default_rng(0)
    ref = rng.normal(0, 3, (20, 64))
    eng = ref.copy()
    eng[7, 3] = np.inf      # one +inf logit (fp16 overflow); top-1 may still agree
    eng[9, :] = np.nan
    rows = step_rows(ref, eng, list(range(20)))
    assert math.isinf(rows[7]["max_abs_dlogits"]) and math.isinf(rows[7]["kl"]) and math.isnan(rows[9]["kl"])
    v = gv.verdict(rows, THRESHOLDS)
    assert v["pass"] is False
    assert ("the bundle's logits are not finite (inf or NaN) at 2/20 step(s), first at step 7: its weights or "
            "activations overflow this recipe's number format") in v["reasons"], v["reasons"]
    assert math.isnan(v["max_abs_dlogits"])       # NaN above any number, not whichever came first
    ok = gv.verdict(step_rows(ref, ref.copy(), list(range(20))), THRESHOLDS)
    assert ok["pass"] and ok["reasons"] == []


def test_quality_statistics_are_the_ones_users_quote():
    rng = np.random.default_rng(1)
    ref = rng.normal(0, 4, (50, 32))
    eng = ref + rng.normal(0, 0.3, ref.shape)
    tokens = list(rng.integers(0, 32, 50))
    rows = step_rows(ref, eng, tokens, eps=0.0)
    q = gv.quality(rows)

    def logp(x):
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    lp, lq = logp(ref), logp(eng)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
    nxt = np.array(tokens[1:])
    nll_ref, nll_eng = -lp[np.arange(49), nxt], -lq[np.arange(49), nxt]
    dp = np.exp(-nll_eng) - np.exp(-nll_ref)
    assert q["kld_mean"] == pytest.approx(kl.mean(), rel=1e-9)
    assert q["kld_median"] == pytest.approx(np.median(kl), rel=1e-9)
    assert q["kld_p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-9)
    assert q["kld_max"] == pytest.approx(kl.max(), rel=1e-9)
    assert q["same_top1"] == pytest.approx(np.mean(ref.argmax(1) == eng.argmax(1)))
    assert q["scored"] == 49
    assert q["rms_dp"] == pytest.approx(np.sqrt(np.mean(dp ** 2)), rel=1e-9)
    assert q["ppl_ref"] == pytest.approx(np.exp(nll_ref.mean()), rel=1e-9)
    assert q["ppl_bundle"] == pytest.approx(np.exp(nll_eng.mean()), rel=1e-9)
    assert q["ppl_ratio"] == pytest.approx(np.exp(nll_eng.mean() - nll_ref.mean()), rel=1e-9)
    assert q["ppl_ratio"] > 1 and q["kld_mean"] > 0
    same = gv.quality(step_rows(ref, ref.copy(), tokens))
    assert same["kld_max"] == 0 and same["same_top1"] == 1 and same["ppl_ratio"] == 1 and same["rms_dp"] == 0
    none = gv.quality([{**r, "nll_ref": math.nan} for r in rows])
    assert none["scored"] == 0 and none["ppl_ratio"] is None and none["rms_dp"] is None


@pytest.mark.parametrize("key", sorted(gv.QUALITY_LIMITS))
@pytest.mark.parametrize("fails", [True, False])
def test_quality_limits_fail_the_gate_when_broken(key, fails):
    """Each limit 1% on the wrong side of the measured statistic fails the gate, 1% on the right side passes."""
    rng = np.random.default_rng(2)
    ref = rng.normal(0, 4, (40, 32))
    eng = ref + rng.normal(0, 1.0, ref.shape)
    rows = step_rows(ref, eng, list(rng.integers(0, 32, 40)), eps=0.0)
    stat, kind = gv.QUALITY_LIMITS[key]
    value = gv.quality(rows)[stat]
    assert 0 < value
    tighter = 0.99 if kind == "max" else 1.01
    limit = value * (tighter if fails else 1 / tighter)
    if key == "max_ppl_ratio":
        limit = max(limit, 1.0) if not fails else limit
    v = gv.verdict(rows, {**THRESHOLDS, "min_agree": 0.0, key: limit})
    assert any(r.startswith(f"{stat} ") and key in r for r in v["reasons"]) is fails, (value, limit, v["reasons"])


def test_a_quality_limit_on_nothing_scored_fails():
    rows = step_rows(np.eye(4) * 5, np.eye(4) * 5, [0], eps=0.0)   # no next token: nothing scored
    v = gv.verdict(rows, {**THRESHOLDS, "max_ppl_ratio": 1.5})
    assert v["reasons"] == ["max_ppl_ratio is set, but the gate scored no step for ppl_ratio"]


@pytest.mark.parametrize("vocab", [256, 566, 768])
def test_small_vocabularies_fit_the_default_gate_without_a_config_edit(vocab):
    """The four default prompts as a byte-level tokenizer writes them (one id a byte: 179 steps with
    one generated step each) and as 566- and 768-id BPEs wrote them in the report (152-163 steps):
    the steps are raised to what they need, every prompt gets its tokens and a generated step."""
    prompts = [f"User: {p}\n\nAssistant:" for p in
               ("Hello, who are you?", "Write a haiku about the sea.", "What is 17 times 23?", "日本の首都はどこですか？")]
    counts = {256: [len(p.encode()) for p in prompts], 566: [37, 38, 36, 48], 768: [36, 38, 35, 50]}[vocab]
    steps = config.gate_step_count(counts, 127)
    assert steps == max(127, sum(c + 1 for c in counts)) and steps > 127
    shares = config.prompt_budgets(counts, steps)
    assert shares == [c + 1 for c in counts]
    assert config.gate_step_count([5, 5, 5, 5], 127) == 127      # short prompts: the configured steps


def test_a_correct_conversion_cannot_fail_on_near_ties_alone():
    """Every reference row a near-tie where the engine picks one of the top 2 (what a correct
    conversion does): the prefill check alone does not fail, and over the whole gate the share rule
    judges decode and prefill rows together."""
    tie = {"ref_top1": 1, "ref_top2": 2, "engine_top1": 2, "near_tie": True, "agree": False,
           "max_abs_dlogits": 0.01, "kl": 1e-4}
    clear = {**tie, "engine_top1": 1, "near_tie": False, "agree": True}
    prefill = [dict(tie, step=i) if i < 3 else dict(clear, step=i) for i in range(7)]    # 4/7 counted
    decode = [dict(clear, step=i) for i in range(127)]
    assert gv.verdict(prefill, THRESHOLDS, counted_over=[])["pass"]
    assert gv.verdict(decode, THRESHOLDS, counted_over=decode + prefill)["pass"]
    assert not gv.verdict(prefill, THRESHOLDS)["pass"]     # the old per-section rule failed it


def test_the_epsilon_follows_the_scale_and_never_exceeds_the_configured_one():
    for scale in (0.5, 4.83, 33.4, 59.2, 1e6):
        eps = gv.epsilon_used(0.1, scale)
        assert eps <= 0.1 and eps <= gv.MAX_EPSILON_SHARE * scale
        assert eps == 0.1 or eps == pytest.approx(gv.MAX_EPSILON_SHARE * scale)


def test_a_reference_that_overflows_is_refused_naming_the_source():
    """Finite weights can make the recurrence overflow (issue 34 item 7: A_log = 100, dt_bias = -200):
    the reference stage refuses NaN logits or states in one line naming the model's own source."""
    from recurrent_coreai.stages.reference import check_finite
    from recurrent_coreai.util.errors import PipelineError

    logits = np.zeros((6, 8), np.float32)
    logits[:, 1] = 3.0
    stream = {"logits": logits, "prompt": np.array([0, 0, 0, 1, 1, 1]), "prefill_logits": logits[:2],
              "prefill_logit_pos": np.array([3, 7]), "prefill_state_pos": np.array([4, 8]),
              "prefill_state_s": np.zeros((2, 3), np.float32)}
    check_finite(stream, "file:ckpt/model.pth", ["a", "b"])
    bad = {**stream, "logits": logits.copy()}
    bad["logits"][4, 2] = np.nan
    with pytest.raises(PipelineError) as exc:
        check_finite(bad, "file:ckpt/model.pth", ["a", "b"])
    assert str(exc.value).startswith("file:ckpt/model.pth: the fp32 reference's logits are not finite (inf or NaN) "
                                     "from step 4 (prompt 1: 'b') on: these weights make the recurrence overflow"), exc.value
    state = {**stream, "prefill_state_s": np.full((2, 3), np.inf, np.float32)}
    with pytest.raises(PipelineError, match="the fp32 reference's state s is not finite"):
        check_finite(state, "file:ckpt/model.pth", ["a", "b"])


@pytest.mark.parametrize("kind", ["hf-bpe", "sp-bpe"])
def test_bpe_dropout_is_refused_in_one_line(kind, tmp_path):
    """Issue 34 item 3: ``model.dropout: 0.5`` made tokenization random; both BPE kinds refuse it."""
    import json

    from recurrent_coreai import tokenizers
    from recurrent_coreai.tokenizers import bpe
    from recurrent_coreai.util.errors import PipelineError

    mod = tokenizers.kind(kind)
    mod.source_files(tmp_path, {"vocab_size": 512})
    path = tmp_path / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    assert spec["model"].get("dropout") in (None, 0, 0.0)
    bpe.parse(path.read_text(encoding="utf-8"), path)            # the file as written: accepted
    spec["model"]["dropout"] = 0.5
    with pytest.raises(PipelineError) as exc:
        bpe.parse(json.dumps(spec), path)
    assert str(exc.value) == (f"{path}: its BPE model has dropout 0.5: encoding is random (each run splits the same "
                              "text differently) -- fix: set model.dropout to null in the tokenizer.json (dropout is a "
                              "training-time regulariser; the checkpoint's own file has null)")
