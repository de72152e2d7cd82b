"""The gate as shards (issue 27): ``gate_shard`` jobs, each a separate job a cluster can place on
its own node, gathered by ``gate`` into the verdict.

* the plan (pipeline/shards.py): every step in exactly one shard, one shard = the unsharded
  gate's order, a prompt cut only where that shortens the longest shard, the shard count from the
  cost model (1 for the tiny defaults, several at 1.5B);
* a shard that starts mid-prompt feeds the prompt's earlier tokens through the bundle's own
  prefill (full chunks) and decode first;
* on a real tiny bundle: any shard count gives the same steps counted and max|dlogits| within
  fp16 noise, one shard gives exactly the build's rows; the records written by the shard stage
  and gathered give the same JSON as the same plan run in one job;
* a missing, stale, reordered, edited or forged shard fails the gather in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from recurrent_coreai.coreai.runtime import PromptSession
from recurrent_coreai.pipeline import config, resources, shards
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.pipeline.records import sealed_text
from recurrent_coreai.stages import gate
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import dumps_json

MODEL, RECIPE = "rwkv7-trained", "fp16"  # rwkv7; a 256-id head: its runtime calls ~7x cheaper than rwkv7-tiny's
ROOT = Path(__file__).resolve().parents[1]


# --- the plan ---------------------------------------------------------------------------------
def _steps(plan):
    return [s for shard in plan for p in shard if not p.get(shards.PREFILL) for s in range(p["start"], p["stop"])]


@pytest.mark.parametrize("lengths", [[32, 32, 32, 31], [36, 31, 30, 30], [5], [128, 128, 1]])
@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 13])
def test_every_step_is_in_exactly_one_shard_and_the_prefill_check_in_one(lengths, count):
    if count > sum(lengths) + 1:  # more shards than pieces there can be
        with pytest.raises(ValueError, match=f"{count} shards are more than the gate's {sum(lengths)} steps"):
            shards.plan(lengths, 133, 64, count)
        return
    plan = shards.plan(lengths, 133, 64, count)
    assert len(plan) == count and all(plan)
    assert _steps(plan) == list(range(sum(lengths)))
    assert sum(p.get(shards.PREFILL, False) for shard in plan for p in shard) == 1
    firsts = np.cumsum([0] + lengths[:-1])
    for p in (p for shard in plan for p in shard if not p.get(shards.PREFILL)):
        assert p["first"] == firsts[p["prompt"]] <= p["start"] < p["stop"] <= p["first"] + lengths[p["prompt"]]


def test_one_shard_is_the_unsharded_gate_in_its_order():
    (only,) = shards.plan([3, 2], 10, 4, 1)
    assert only == [{shards.PREFILL: True}, {"prompt": 0, "first": 0, "start": 0, "stop": 3},
                    {"prompt": 1, "first": 3, "start": 3, "stop": 5}]


def test_a_prompt_is_cut_only_where_it_shortens_the_longest_shard():
    # 4 prompts of ~32 steps, a 64-token chunk: a cut mid-prompt repays its warm-up in decode calls,
    # so 5 shards (the prefill check and one per prompt) are the shortest the gate gets
    plan = shards.plan([32, 32, 32, 31], 133, 64, 5)
    assert all(p.get(shards.PREFILL) or p["start"] == p["first"] for shard in plan for p in shard)
    assert shards.critical_cost([32, 32, 32, 31], 133, 64, 5) == 32
    assert shards.critical_cost([32, 32, 32, 31], 133, 64, 8) == 32
    assert shards.shard_count([32, 32, 32, 31], 133, 64, call_seconds=None, shard_seconds=600) == 5
    # long prompts: a cut past a chunk is fed through prefill, which costs less than its steps
    assert shards.critical_cost([256], 16, 8, 4) < shards.critical_cost([256], 16, 8, 2) / 1.5
    assert shards.warmup_cost(130, 64) == 2 * shards.prefill_call_cost(64) + 2


def test_the_tiny_defaults_are_one_shard_and_the_1_5b_int8_gate_is_several():
    cfg = config.load(ROOT / "config.yaml")
    for model in config.models_to_build(cfg):
        for recipe in cfg["models"][model]["recipes"]:
            assert resources.gate_shards(cfg, model, recipe) == 1, (model, recipe)
    big = resources.gate_shards(cfg, "rwkv7-1.5b-shape", "int8keepproj")
    assert big > 1
    lengths, tokens, chunk, text = resources.gate_plan_shape(cfg, "rwkv7-1.5b-shape", "int8keepproj")
    whole = shards.critical_cost(lengths, tokens, chunk, 1, text)
    # the longest piece that cannot be cut: the text stream's last horizon from zero states (31
    # prefill calls and its 64 scored tokens through main); sharding reaches it
    floor = shards.text_piece_cost(text, chunk, [len(text[1]) - 1])
    assert floor == pytest.approx(31 * shards.prefill_call_cost(64) + 64)
    assert shards.critical_cost(lengths, tokens, chunk, big, text) == pytest.approx(floor) and floor < whole / 2.5
    # an hf checkpoint's size is not known when Snakemake plans: as many shards as shorten the gate
    assert resources.gate_shards(cfg, "rwkv7-goose-1.5b", "int8keepproj") == big


class Recorder:
    """A session that records what the gate feeds it (the real PromptSession.feed on top)."""

    chunk = 4
    aimodelx = Path("fake.aimodelx")
    feed = PromptSession.feed

    def __init__(self):
        self.calls = []

    def reset(self):
        self.calls.append(("reset",))

    def prefill_chunk(self, tokens):
        self.calls.append(("prefill", list(tokens)))
        return np.zeros(32)

    def step(self, token):
        self.calls.append(("step", int(token)))
        return np.eye(32)[int(token) % 32]


def test_a_shard_that_starts_mid_prompt_feeds_the_earlier_tokens_through_prefill_then_decode():
    stream = {"tokens": np.arange(20), "prompt": np.array([0] * 3 + [1] * 17), "pos": np.arange(20),
              "logits": np.zeros((20, 32), np.float32)}   # a row for every token id, as a real vocabulary has
    sess = Recorder()
    rows = gate.decode_rows(sess, stream, 0.1, start=13, stop=16, first=3)
    assert [r["step"] for r in rows] == [13, 14, 15]
    assert sess.calls == [("reset",), ("prefill", [3, 4, 5, 6]), ("prefill", [7, 8, 9, 10]), ("step", 11), ("step", 12),
                          ("step", 13), ("step", 14), ("step", 15)]
    # from a prompt's first step: a reset and nothing fed
    sess = Recorder()
    gate.decode_rows(sess, stream, 0.1, start=3, stop=5, first=3)
    assert sess.calls == [("reset",), ("step", 3), ("step", 4)]


# --- on a real tiny bundle --------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_results):
    lay = Layout(tiny_results, MODEL)
    cfg = config.load(tiny_results.parent / "config.yaml")  # the build's own
    settings = config.gate_settings(config.settings(cfg, "gate", model=MODEL, recipe=RECIPE), RECIPE)
    inputs = gate.gate_inputs(MODEL, RECIPE, lay.export(RECIPE), lay.aot("universal", RECIPE), lay.reference, settings)
    return lay, settings, inputs


def test_one_shard_gives_the_builds_rows_and_more_shards_the_same_verdict(tiny):
    lay, settings, inputs = tiny
    args = (inputs["aimodelx"], inputs["record"], inputs["stream"], settings)
    one, rows_one = gate.run_gate(*args, shard_count=1)
    built = json.loads(lay.gate_json(RECIPE).read_text())
    assert built["shards"] == one["shards"] == {"count": 1, "steps": [len(rows_one)], "mid_prompt_starts": 0}
    assert gate.tsv_text(rows_one) == lay.gate_tsv(RECIPE).read_text()
    lengths = gate.prompt_lengths(inputs["stream"])
    # more shards than prompts and the text stream's pieces (one per horizon): some start mid-prompt
    count = len(lengths) + len(inputs["stream"]["text_horizons"]) + 4
    many, rows_many = gate.run_gate(*args, shard_count=count)
    assert many["shards"]["count"] == count and many["shards"]["mid_prompt_starts"] >= 3
    assert [r["step"] for r in rows_many] == [r["step"] for r in rows_one]
    for key in ("steps", "counted", "agree_counted", "near_ties", "pass"):
        assert many[key] == one[key], key
    assert many["prefill"] == one["prefill"]
    # an engine-made state is the start: the same logits up to fp16 noise
    assert abs(many["max_abs_dlogits"] - one["max_abs_dlogits"]) < 0.02
    assert max(abs(a["max_abs_dlogits"] - b["max_abs_dlogits"]) for a, b in zip(rows_one, rows_many)) < 0.02


@pytest.fixture(scope="module")
def shard_records(tiny, tmp_path_factory):
    """Three shard records written by the shard stage's code, and what the same plan gives in one job."""
    lay, settings, inputs = tiny
    out = tmp_path_factory.mktemp("shards")
    paths = [out / f"shard-{k}.json" for k in range(3)]
    for k, path in enumerate(paths):
        gate.run_shard(MODEL, RECIPE, inputs, settings, k, 3, path)
    return paths


def _gather(tiny, paths, out: Path):
    lay, settings, _ = tiny
    return gate.gate_bundle(MODEL, RECIPE, lay.export(RECIPE), lay.aot("universal", RECIPE), lay.reference, settings,
                            out / "g.json", out / "g.tsv", shard_paths=paths)


def test_the_gathered_shards_give_what_one_job_gives_for_the_same_plan(tiny, shard_records, tmp_path):
    lay, settings, inputs = tiny
    res = _gather(tiny, shard_records, tmp_path)
    one, rows = gate.run_gate(inputs["aimodelx"], inputs["record"], inputs["stream"], settings, shard_count=3)
    # the text stream's last position has no next token: NaN likelihoods, equal only as JSON text
    assert json.dumps({k: res[k] for k in one}, sort_keys=True) == json.dumps(one, sort_keys=True)
    assert (tmp_path / "g.tsv").read_text() == gate.tsv_text(rows)
    assert res["shards"]["count"] == 3 and res["bundle_sha256"] == json.loads(lay.gate_json(RECIPE).read_text())["bundle_sha256"]


def _resealed(path: Path, dest: Path, change) -> Path:
    rec = json.loads(path.read_text())
    change(rec)
    dest.write_text(sealed_text(rec, "gate_shard"))
    return dest


def _edited(path: Path, where: Path) -> Path:
    rec = json.loads(path.read_text())
    rec["results"][-1][0]["engine_top1"] += 1
    (where / "s.json").write_text(dumps_json(rec))  # the old seal kept
    return where / "s.json"


@pytest.mark.parametrize("damage, needle", [
    (lambda p, d: d / "nothing.json", "nothing.json: missing (the gate_shard stage writes it)"),
    (_edited, "differs from what the gate_shard stage recorded"),
    (lambda p, d: _resealed(p, d / "s.json", lambda r: r.__setitem__("reference_sha256", "0" * 64)),
     "is a gate shard of another reference stream"),
    (lambda p, d: _resealed(p, d / "s.json", lambda r: r["tested_files"]["aimodel"].__setitem__("x", {})),
     "is a gate shard of other bundle or lowering bytes"),
    (lambda p, d: _resealed(p, d / "s.json", lambda r: r["settings"].__setitem__("near_tie_epsilon", 0.0)),
     "is a gate shard of other gate settings"),
    (lambda p, d: _resealed(p, d / "s.json", lambda r: r["pieces"][-1].__setitem__("stop", r["pieces"][-1]["stop"] - 1)),
     "is a gate shard of other steps than shard 1 of 3"),
    (lambda p, d: _resealed(p, d / "s.json", lambda r: r.__setitem__("results", r["results"][:-1])),
     "holds no result for some of its pieces"),
    (lambda p, d: _resealed(p, d / "s.json", lambda r: r.pop("lowering_run")),
     "does not say which lowering it ran"),
])
def test_a_missing_stale_or_edited_shard_fails_the_gather_in_one_line(tiny, shard_records, tmp_path, damage, needle):
    paths = list(shard_records)
    paths[1] = damage(paths[1], tmp_path)
    with pytest.raises(PipelineError) as exc:
        _gather(tiny, paths, tmp_path)
    assert needle in str(exc.value) and "\n" not in str(exc.value)
    assert "--forcerun gate_shard" in str(exc.value)
    assert not (tmp_path / "g.json").exists()


def test_shards_in_another_order_or_count_are_refused(tiny, shard_records, tmp_path):
    with pytest.raises(PipelineError, match=r"shard-1.json: is a gate shard of shard 1, not 0"):
        _gather(tiny, [shard_records[1], shard_records[0], shard_records[2]], tmp_path)
    with pytest.raises(PipelineError, match=r"shard-0.json: is a gate shard of 3 shards, not 2"):
        _gather(tiny, shard_records[:2], tmp_path)


def test_with_a_record_key_a_forged_shard_is_refused(tiny, shard_records, tmp_path, monkeypatch):
    """A seal is a digest anyone can recompute; with RECURRENT_COREAI_RECORD_KEY set the shards
    carry a MAC, and a shard edited and sealed again without the key is refused (the gather's
    check of the shards, read_shards; the other records of the tree are sealed without a key)."""
    _, settings, inputs = tiny
    monkeypatch.setenv("RECURRENT_COREAI_RECORD_KEY", "k" * 32)
    keyed = [tmp_path / f"shard-{k}.json" for k in range(3)]
    for path, made in zip(keyed, shard_records):  # what the stage writes with the key set (run_shard: sealed_text)
        path.write_text(sealed_text(json.loads(made.read_text()), "gate_shard"))
    plan, done, runs = gate.read_shards(keyed, MODEL, RECIPE, inputs, settings)
    assert len(plan) == len(done) == len(runs) == 3 and {r["ran"] for r in runs} == {gate.PIPELINE}  # fp16
    with pytest.raises(PipelineError, match="shard-0.json: differs from what the gate_shard stage recorded: its MAC"):
        gate.read_shards(shard_records, MODEL, RECIPE, inputs, settings)  # sealed without the key
    monkeypatch.delenv("RECURRENT_COREAI_RECORD_KEY")
    forged = _resealed(keyed[2], tmp_path / "forged.json", lambda r: r["results"][-1][0].__setitem__("agree", True))
    monkeypatch.setenv("RECURRENT_COREAI_RECORD_KEY", "k" * 32)
    with pytest.raises(PipelineError, match="forged.json: differs from what the gate_shard stage recorded: its MAC"):
        gate.read_shards(keyed[:2] + [forged], MODEL, RECIPE, inputs, settings)


def test_a_shard_beyond_the_count_is_one_line(tiny, tmp_path):
    _, settings, inputs = tiny
    with pytest.raises(PipelineError) as exc:
        gate.run_shard(MODEL, RECIPE, inputs, settings, 5, 3, tmp_path / "shard-5.json")
    assert str(exc.value) == (f"{tmp_path / 'shard-5.json'}: is shard 5 of 3: there is no such shard -- fix: "
                              "run shards 0..2 (--shard K --shards 3)")
    assert not (tmp_path / "shard-5.json").exists()
