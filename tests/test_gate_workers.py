"""The gate in several processes (issue 13: a gate that finishes at 1.5B): its work splits into
independent units (each prompt's decode stream, the prefill check), and any number of runtime
processes gives the same rows and verdict as one. Run on a real tiny bundle of the session's
build (``tiny_results``) in the Core AI Linux runtime."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recurrent_coreai.pipeline import config, warm
from recurrent_coreai.stages import gate
from recurrent_coreai.pipeline import resources
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.pipeline.records import PROMPT_TOKENS, read_aot, read_export

MODEL, RECIPE = "rwkv7-trained", "fp16"  # rwkv7; a 256-id head: its runtime calls ~7x cheaper than rwkv7-tiny's
ROOT = Path(__file__).resolve().parents[1]


def test_one_shard_covers_every_step_once_and_its_pieces_start_at_a_prompt():
    stream = {"prompt": np.array([0, 0, 0, 1, 1, 2, 2, 2, 2]), "prefill_tokens": np.zeros(9), "prefill_chunk": 4}
    assert gate.prompt_lengths(stream) == [3, 2, 4]
    (pieces,) = gate.shard_plan(stream, 1)
    assert pieces[0] == {"prefill": True}
    assert [(p["start"], p["stop"]) for p in pieces[1:]] == [(0, 3), (3, 5), (5, 9)]
    assert all(p["first"] == p["start"] for p in pieces[1:])


@pytest.fixture(scope="module")
def bundle(tiny_results):
    lay = Layout(tiny_results, MODEL)
    record = read_export(lay.export(RECIPE))
    aimodelx = lay.aot("universal", RECIPE) / read_aot(lay.aot("universal", RECIPE))["product"]
    with np.load(lay.reference) as npz:
        stream = {k: npz[k] for k in npz.files}
    cfg = config.load(tiny_results.parent / "config.yaml")  # the build's own
    settings = config.gate_settings(config.settings(cfg, "gate", model=MODEL, recipe=RECIPE), RECIPE)
    return aimodelx, record, stream, settings


def test_two_processes_give_the_rows_and_verdict_of_one(bundle):
    one, rows_one = gate.run_gate(*bundle, workers=1)
    two, rows_two = gate.run_gate(*bundle, workers=2)
    assert len(rows_one) == len(bundle[2]["tokens"]) and len(set(r["prompt"] for r in rows_one)) > 1
    assert json.dumps(rows_two) == json.dumps(rows_one)    # NaN (an unscored step's likelihood) equal to NaN
    # the text stream's last position has no next token: NaN likelihoods, equal only as JSON text
    assert json.dumps(two, sort_keys=True) == json.dumps(one, sort_keys=True) and one["pass"] is True


@pytest.mark.parametrize("warm_process", [False, True], ids=["its own process", "the run's warm process"])
def test_the_stage_script_in_two_processes_writes_what_the_build_wrote(tiny_results, tmp_path, warm_process,
                                                                       monkeypatch):
    """``python scripts/gate.py`` as the rule runs it, granted 2 threads the way Snakemake grants
    them (OMP_NUM_THREADS): its spawned workers import the script too (it must not rerun the
    stage), and the JSON and TSV equal the ones the build's one-process gate wrote. The same
    through a Snakemake run's warm process (pipeline/warm.py), whose workers are spawned from it."""
    lay, conf = Layout(tiny_results, MODEL), tiny_results.parent / "config.yaml"
    out = tmp_path / "gate"
    # the build's file names: the gate JSON records its TSV's name (and is sealed)
    json_out, tsv_out = out / lay.gate_json(RECIPE).name, out / lay.gate_tsv(RECIPE).name
    cmd = [sys.executable, "scripts/gate.py", "--config-file", str(conf), "--model", MODEL, "--recipe", RECIPE,
           "--export", str(lay.export(RECIPE)), "--aot", str(lay.aot("universal", RECIPE)),
           "--reference", str(lay.reference), "--json", str(json_out), "--tsv", str(tsv_out),
           "--log", str(out / "g.log")]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    env.pop("SLURM_CPUS_PER_TASK", None)
    env.pop(warm.SOCKET_ENV, None)
    if warm_process:
        monkeypatch.delenv(warm.SWITCH_ENV, raising=False)
        env[warm.SOCKET_ENV] = warm.open_run(os.getpid())
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        said = warm.close_run() if warm_process else None
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert said == ("warm process: ran 1 job(s) (gate 1)" if warm_process else None)
    assert "step(s) and the prefill check and the text stream in 2 process(es)" in (out / "g.log").read_text()
    assert tsv_out.read_bytes() == lay.gate_tsv(RECIPE).read_bytes()
    assert json.loads(json_out.read_text()) == json.loads(lay.gate_json(RECIPE).read_text())


class Unloadable:
    """A session factory whose bundle cannot load (in the worker processes)."""

    def __init__(self, aimodelx, export_record):
        raise PipelineError(aimodelx, "has no loadable function 'main'", "rerun the export and aot stages")


class Killed:
    """A session factory whose worker process is killed (as the OOM killer would)."""

    def __init__(self, aimodelx, export_record):
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("factory, needle", [
    (Unloadable, "has no loadable function 'main' -- fix: rerun the export and aot stages"),
    (Killed, "a gate process died (killed by the system, often for memory) while 2 ran at once -- fix: "),
])
def test_a_worker_failure_is_the_stages_one_line_error(tmp_path, factory, needle):
    stream = {"prompt": np.array([0, 0, 1, 1]), "tokens": np.array([0, 1, 0, 1]), "prefill_tokens": np.zeros(5),
              "prefill_chunk": 4}
    with pytest.raises(PipelineError) as err:
        gate.run_gate(tmp_path / "x.aimodelx", {}, stream, {"near_tie_epsilon": 0.1}, session_factory=factory,
                      workers=2)
    assert needle in str(err.value) and str(err.value).startswith(str(tmp_path / "x.aimodelx"))


def test_workers_are_what_the_scheduler_granted(monkeypatch):
    for var in ("SLURM_CPUS_PER_TASK", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    assert gate.workers_granted() == 1                      # dvc repro, a stage by hand
    monkeypatch.setenv("OMP_NUM_THREADS", "3")              # Snakemake's threads for the job
    assert gate.workers_granted() == 3
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")          # a SLURM allocation wins
    assert gate.workers_granted() == 4
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "")
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert gate.workers_granted() == 1


def test_gate_threads_follow_the_configured_shape(cfg):
    threads = resources.gate_threads(cfg)

    class W:
        def __init__(self, model):
            self.model = model

    assert threads(W("rwkv7-tiny")) == 1                    # 17 M parameters: one process
    assert threads(W("rwkv7-1.5b-shape")) == 4              # 1.5 B: cpus_for; Snakemake caps at --cores
    assert threads(W("rwkv7-goose-1.5b")) == resources.MAX_GATE_THREADS   # hf: shape unknown before download


def test_the_gate_log_says_how_many_processes(tiny_results):
    log = Layout(tiny_results, MODEL).log(f"gate-{RECIPE}-shard-0")  # the one shard ran the steps
    assert "step(s) and the prefill check and the text stream in 1 process(es)" in log.read_text()


def test_a_models_own_steps_compare_each_prompts_first_share(tiny_results, tmp_path):
    """models/<model>/gate/steps: the stage compares each prompt's first share of the fewer steps,
    taken from the same reference stream. Those are the steps a reference made for that many
    holds (computed independently here), their rows are the full gate's rows for the same
    (prompt, pos), and the JSON states the count, the reference's count and the reason."""
    import yaml

    from recurrent_coreai.stages.reference import reference_stream
    from recurrent_coreai import families, tokenizers

    # a model whose prompts fit config.yaml's steps (a byte vocabulary's need more: its gate raises
    # them, and fewer could not be asked for), with a cheap runtime call
    model, recipe = "gdn-tiny", "int8keepstate"
    lay = Layout(tiny_results, model)
    raw = yaml.safe_load((tiny_results.parent / "config.yaml").read_text())
    full_steps, n_prompts = raw["gate"]["steps"], len(raw["gate"]["prompts"])
    steps = full_steps - 11  # an odd count: the first prompt gets the extra step
    why = "measured: the runtime dequantises every int8 weight on every call"
    raw["models"][model]["gate"] = {"steps": {recipe: steps}, "why": why}
    conf = tmp_path / "config.yaml"
    conf.write_text(yaml.safe_dump(raw))

    with np.load(lay.reference) as npz:
        stream = {k: npz[k] for k in npz.files}
    part = gate.gate_steps(stream, n_prompts, steps, lay.reference)
    fresh = reference_stream(families.get(raw["models"][model]["family"]), lay.source, tokenizers.kind(families.tokenizer_of(raw["models"][model])).load(lay.vocab),
                             raw["gate"]["prompts"], steps)
    for key in ("tokens", "prompt", "pos"):
        assert np.array_equal(part[key], fresh[key]), key
    assert np.allclose(part["logits"], fresh["logits"], atol=1e-5)
    assert np.array_equal(part["prefill_tokens"], stream["prefill_tokens"])

    out = tmp_path / "gate"
    cmd = [sys.executable, "scripts/gate.py", "--config-file", str(conf), "--model", model, "--recipe", recipe,
           "--export", str(lay.export(recipe)), "--aot", str(lay.aot("universal", recipe)),
           "--reference", str(lay.reference), "--json", str(out / "g.json"), "--tsv", str(out / "g.tsv"),
           "--log", str(out / "g.log")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
        env.pop(var, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result, built = (json.loads(p.read_text()) for p in (out / "g.json", lay.gate_json(recipe)))
    assert (result["steps"], result["reference_steps"], result["steps_why"]) == (steps, full_steps, why)
    assert built["reference_steps"] == built["steps"] == full_steps and "steps_why" not in built

    def rows(tsv):
        head, *lines = tsv.read_text().splitlines()
        cols = head.split("\t")
        return {(r["prompt"], r["pos"]): {k: v for k, v in r.items() if k != "step"}
                for r in (dict(zip(cols, line.split("\t"))) for line in lines)}

    few, every = rows(out / "g.tsv"), rows(lay.gate_tsv(recipe))
    # a prompt's last compared step has no next token in the fewer steps: its likelihood is not scored
    scoring = ("nll_ref", "nll_eng", "dp")
    few_scored = {k: r for k, r in few.items() if r["nll_ref"] != "nan"}
    assert len(few) - len(few_scored) == len(result["prompts"])
    assert len(few) == steps and few_scored == {key: every[key] for key in few_scored}
    assert all({c: v for c, v in r.items() if c not in scoring} == {c: v for c, v in every[k].items() if c not in scoring}
               for k, r in few.items())
    shares = [sum(1 for p, _ in few if p == str(i)) for i in range(n_prompts)]
    # every prompt fit its equal share of gate/steps (the stream records no token counts): equal shares
    assert PROMPT_TOKENS not in stream and shares == config.prompt_budgets([0] * n_prompts, steps)
    assert sum(shares) == steps
    assert result["prefill"] == built["prefill"]


def test_a_stream_with_fewer_steps_than_the_gates_share_is_refused(tmp_path):
    stream = {"prompt": np.array([0, 0, 0, 1, 1]), "tokens": np.arange(5), "pos": np.array([0, 1, 2, 0, 1]),
              "logits": np.zeros((5, 3))}
    assert gate.gate_steps(stream, 2, 4, tmp_path / "s.npz")["tokens"].tolist() == [0, 1, 3, 4]
    with pytest.raises(PipelineError, match=r"s\.npz: holds 5 steps, fewer than the 6 this gate compares -- fix: set "
                                            r"the model's gate/steps for this recipe to at most gate/steps"):
        gate.gate_steps(stream, 2, 6, tmp_path / "s.npz")
    stale = {**stream, "prompt": np.array([0, 0, 0, 0, 1])}  # made for other prompts or steps
    with pytest.raises(PipelineError, match=r"s\.npz: holds 1 step\(s\) of prompt 1, fewer than the gate's share "
                                            r"\(2\) of 4 steps -- fix: rerun the reference stage"):
        gate.gate_steps(stale, 2, 4, tmp_path / "s.npz")


def test_fewer_steps_keep_a_long_prompts_tokens_where_the_reference_recorded_them(tmp_path):
    """A reference whose prompt 0 needed more than its equal share records the prompts' token
    counts; the gate shares fewer steps by the same rule (config.prompt_budgets), so the long
    prompt keeps its tokens and a generated step, and too few steps for the prompts is one line."""
    counts, full = [5, 1], 10                       # needs 6 and 2: shares 6 and 4 of 10
    assert config.prompt_budgets(counts, full) == [6, 4]
    prompt = np.array([0] * 6 + [1] * 4)
    pos = np.array(list(range(6)) + list(range(4)))
    stream = {"prompt": prompt, "tokens": np.arange(10), "pos": pos, "logits": np.zeros((10, 3)),
              PROMPT_TOKENS: np.array(counts)}
    part = gate.gate_steps(stream, 2, 8, tmp_path / "s.npz")   # 8 steps: 6 and 2, not the equal 4 and 4
    assert part["prompt"].tolist() == [0] * 6 + [1] * 2 and part["pos"].tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    without = {k: v for k, v in stream.items() if k != PROMPT_TOKENS}   # nothing recorded: equal shares
    assert gate.gate_steps(without, 2, 8, tmp_path / "s.npz")["prompt"].tolist() == [0] * 4 + [1] * 4
    # fewer steps than the prompts need are raised to the need (config.gate_step_count), not refused
    raised = gate.gate_steps(stream, 2, 7, tmp_path / "s.npz", "config.yaml", "models/m/gate/steps/int8")
    assert raised["steps_used"] == 8 and raised["prompt"].tolist() == [0] * 6 + [1] * 2
    longer = {**stream, PROMPT_TOKENS: np.array([5, 5])}    # needs 12: more than the stream's 10 steps
    with pytest.raises(PipelineError) as exc:
        gate.gate_steps(longer, 2, 8, tmp_path / "s.npz")
    assert str(exc.value).startswith(f"{tmp_path / 's.npz'}: holds 10 steps, fewer than the 12 this gate compares"), exc.value
    with pytest.raises(PipelineError, match=r"s\.npz: records the token counts of 2 prompts, not of the gate's 3"):
        gate.gate_steps(stream, 3, 8, tmp_path / "s.npz")
