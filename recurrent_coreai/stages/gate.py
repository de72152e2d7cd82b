"""The parity gate: teacher-forced comparison of a Core AI bundle against the reference.

1. :func:`reference_stream` (once per model): for every prompt, token 0 then
   ``User: {prompt}\\n\\nAssistant:``, extended by the fp32 reference's greedy continuation up
   to the prompt's share of the step budget; the reference logits at every step are stored.
2. :func:`run_gate` (per recipe): the SAME fixed token stream is fed to the Core AI runtime
   through the decode function; per step we compare the argmax and max|Δlogits|. A step where
   the reference's top-2 margin is below the near-tie epsilon is a near-tie: the engine may pick
   either of the two; too few steps outside near-ties (``min_counted``, over the decode and prefill
   rows together) fails the gate. The epsilon is ``near_tie_epsilon``, at most a fixed share of the
   reference's logit scale (stages/gate_verdict.py: every rule that decides pass or fail).
3. The prefill check (:func:`prefill_check`): the reference's continuous prefill stream goes
   through the bundle's prefill function in full chunks and its tail through decode, on the
   same states; each chunk's last-position logits and every tail step are compared the same way,
   and the states after each chunk and at the end must be within the recipe's
   ``prefill_max_rel_dstate`` of the reference's, relative to each state's own largest
   magnitude (and within ``prefill_max_abs_dstate`` where a config sets that absolute bound).
   It fails the gate like any other check.
4. The contract: every function of the bundle writes each state exactly once per call.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from recurrent_coreai.pipeline import shards, stage
from recurrent_coreai.coreai import toolchain
from recurrent_coreai.pipeline.config import gate_settings, gate_step_count, prompt_budgets
from recurrent_coreai.coreai.runtime import PromptSession
from recurrent_coreai.coreai.entrypoints import DECODE, PREFILL, bundle_functions, split_prompt, text_piece
from recurrent_coreai.stages.gate_lowering import FOLDED, PIPELINE, gate_lowering
from recurrent_coreai.stages.gate_verdict import (MAX_EPSILON_SHARE, compare, counted_reasons, epsilon_used,  # noqa: F401
                                                  logit_scale, relative_diffs, state_diffs, state_scales, text_verdict,
                                                  verdict, worst)
from recurrent_coreai.util.errors import PipelineError, main_guard
from recurrent_coreai.util.fsutil import atomic_path, dumps_json, sha256_file, tree_manifest
from recurrent_coreai.util import numpy_simd
from recurrent_coreai.util.progress import progress
from recurrent_coreai.pipeline.records import (PROMPT_TOKENS, check_seal, read_aot, read_export, read_stream, rerun_fix,
                                               sealed_text)

TSV_COLUMNS = ("step", "prompt", "pos", "token", "ref_top1", "ref_top2", "engine_top1", "ref_margin",
               "near_tie", "agree", "max_abs_dlogits", "kl", "nll_ref", "nll_eng", "dp")


def contract_problems(export_record: dict) -> list[str]:
    """Structural checks the numbers cannot see on this host (the Linux runtime executes
    several writes to one state correctly; the device GPU delegate keeps only one): every
    function writes each of its states exactly once per call."""
    problems = []
    functions = export_record.get("functions") or {}
    roles = {f.get("role") for f in functions.values()}
    for role in (DECODE, PREFILL):
        if role not in roles:
            problems.append(f"export.json records no {role} function")
    for fn, spec in sorted(functions.items()):
        writes = spec.get("state_writes")
        if writes is None:
            problems.append(f"export.json does not record the state writes of function {fn}")
            continue
        for name, n in sorted(writes.items()):
            if n != 1:
                problems.append(f"state {name} is written {n} times per call of {fn} (must be exactly once, at the end)")
    return problems


def checked_logit_scale(stream: dict, stream_path: Path) -> float:
    """The reference's logit scale (gate_verdict.logit_scale), which the near-tie epsilon follows;
    one line when it is not a positive number (a reference whose logits are all equal or not finite)."""
    scale = logit_scale(stream["logits"])
    if not (np.isfinite(scale) and scale > 0):
        raise PipelineError(stream_path, f"has a logit scale (median max-min logit) of {scale:g}: its logits are "
                            "constant or not finite, so no top-1 pick can be compared", "check the model's weights, "
                            "then rerun the reference stage (snakemake --forcerun reference)")
    return scale


def decode_rows(sess, stream: dict, eps: float, start: int = 0, stop: int | None = None,
                first: int | None = None) -> list[dict]:
    """Steps ``start``..``stop`` of the per-prompt streams through the decode function, states
    reset at each new prompt. A run that starts mid-prompt names that prompt's ``first`` step:
    the prompt's tokens ``first``..``start-1`` go through the bundle's own functions first --
    full chunks through prefill, the rest through decode (``PromptSession.feed``) -- and are not
    compared: the engine's own state is where the compared steps start (pipeline/shards.py)."""
    rows: list[dict] = []
    prev_prompt = None
    stop = len(stream["tokens"]) if stop is None else stop
    if first is not None and first < start:
        sess.reset()
        sess.feed([int(t) for t in stream["tokens"][first:start]])
        prev_prompt = stream["prompt"][start]
    label = f"gate {Path(sess.aimodelx).stem}"  # e.g. gate rwkv7-tiny-fp16
    for step in progress(range(start, stop), label, stop - start, "steps"):
        tok, prompt, pos = stream["tokens"][step], stream["prompt"][step], stream["pos"][step]
        if prompt != prev_prompt:
            sess.reset()
            prev_prompt = prompt
        eng = sess.step(int(tok))
        row = {"step": step, "prompt": int(prompt), "pos": int(pos), "token": int(tok)}
        row.update(compare(stream["logits"][step].astype(np.float64), eng, eps, next_token(stream, step)))
        for key, value in NOT_SCORED.items():
            row.setdefault(key, value)
        rows.append(row)
    return rows


# a step whose next token the stream does not hold (a prompt's last): no likelihood scored
NOT_SCORED = {"nll_ref": float("nan"), "nll_eng": float("nan"), "dp": float("nan")}


def next_token(stream: dict, step: int) -> int | None:
    """The token the stream feeds after ``step`` within the same prompt (None at a prompt's last step)."""
    if step + 1 < len(stream["tokens"]) and stream["prompt"][step + 1] == stream["prompt"][step]:
        return int(stream["tokens"][step + 1])
    return None




def reference_states(stream: dict, prefix: str, k: int) -> dict[str, np.ndarray]:
    """The reference's states stored under ``prefix`` (``prefill_state_``, ``text_state_``) at
    their ``k``-th recorded position, by state name (the ``<prefix>pos`` index excluded)."""
    return {name[len(prefix):]: arr[k] for name, arr in stream.items()
            if name.startswith(prefix) and name != f"{prefix}pos"}


def state_comparison(sess, ref: dict[str, np.ndarray]) -> tuple[dict, dict, dict]:
    """The session's states against ``ref``: per state max|Δ|, that over the state's own largest
    reference magnitude, and that magnitude."""
    diffs, scales = state_diffs(sess.state_arrays(), ref), state_scales(ref)
    return diffs, relative_diffs(diffs, scales), scales


def prefill_check(sess: PromptSession, stream: dict, thresholds: dict, eps: float) -> dict:
    """The reference's continuous prefill stream through prefill (full chunks) and decode (the
    tail) from zero states; logits compared where the bundle reports them, states after each
    chunk and at the end: each state's max|Δ|, and that over the state's own max|reference|
    (``prefill_max_rel_dstate``; ``prefill_max_abs_dstate``, where set, bounds max|Δ| as well).
    Returns the ``prefill`` section of the gate result (with its rows)."""
    tokens, T = [int(t) for t in stream["prefill_tokens"]], sess.chunk
    full = split_prompt(len(tokens), T)[0] * T
    logit_at = {int(p): i for i, p in enumerate(stream["prefill_logit_pos"])}
    state_at = {int(n): i for i, n in enumerate(stream["prefill_state_pos"])}
    sess.reset()
    rows: list[dict] = []
    found: list[tuple[float, float, float, str, int]] = []  # (relative, max|Δ|, scale, state, after tokens)

    def record(function: str, pos: int, eng: np.ndarray) -> None:
        row = {"step": len(rows), "function": function, "pos": pos, "token": tokens[pos]}
        row.update(compare(stream["prefill_logits"][logit_at[pos]].astype(np.float64), eng, eps))
        row["max_abs_dstate"] = row["max_rel_dstate"] = None
        if pos + 1 in state_at:
            row["max_abs_dstate"], row["max_rel_dstate"], scales = state_comparison(
                sess, reference_states(stream, "prefill_state_", state_at[pos + 1]))
            found.extend((row["max_rel_dstate"][n], d, scales[n], n, pos + 1) for n, d in row["max_abs_dstate"].items())
        rows.append(row)

    for start in range(0, full, T):
        record(sess.prefill_function, start + T - 1, sess.prefill_chunk(tokens[start:start + T]))
    for pos in range(full, len(tokens)):
        record(sess.function, pos, sess.step(tokens[pos]))
    result = verdict(rows, thresholds, counted_over=[])  # counted with the decode rows: gather()
    rel, rel_d, scale, name, after = worst(found)
    dabs, _, _, abs_name, abs_after = worst([(d, r, s, n, p) for r, d, s, n, p in found])
    limit = thresholds.get("prefill_max_rel_dstate")
    if limit is not None and not rel <= limit:  # NaN fails too
        result["reasons"].append(f"state {name} after {after} tokens differs from the reference's by {rel:.3g} of its "
                                 f"largest magnitude ({rel_d:.3g} of {scale:.3g}) > {limit:g}")
    limit = thresholds.get("prefill_max_abs_dstate")
    if limit is not None and not dabs <= limit:  # NaN fails too
        result["reasons"].append(f"state {abs_name} after {abs_after} tokens differs from the reference's by "
                                 f"{dabs:.3g} > {limit:g}")
    result["pass"] = not result["reasons"]
    result.update({"function": sess.prefill_function, "decode_function": sess.function, "chunk": T,
                   "tokens": len(tokens), "chunks": full // T, "tail": len(tokens) - full,
                   "max_abs_dstate": dabs, "max_rel_dstate": rel, "rows": rows})
    return result


def text_check(sess: PromptSession, stream: dict, eps: float, idx: list[int] | None = None) -> dict:
    """A piece of the reference's long held-out text stream (the horizons ``idx``; None: all)
    from zero states through the bundle as entrypoints.text_piece runs it: full chunks through
    prefill, the chunk before each of its horizons and a short tail through decode; logits
    compared wherever the bundle reports them in its part (every row holds the stream's next
    token's likelihoods where the stream has one), every state at each of its horizons. Returns
    its ``rows`` and ``states`` (horizon -> state -> numbers); the gather judges the pieces
    together (:func:`text_result`)."""
    tokens, T = [int(t) for t in stream["text_tokens"]], sess.chunk
    horizons = [int(h) for h in stream["text_horizons"]]
    runs, first, mine = text_piece(len(tokens), T, horizons, idx)
    logit_at = {int(p): i for i, p in enumerate(stream["text_logit_pos"])}
    sess.reset()
    rows: list[dict] = []
    states: dict[str, dict] = {}

    def record(function: str, pos: int, eng: np.ndarray) -> None:
        if pos < first:
            return  # another piece reports it
        nxt = tokens[pos + 1] if pos + 1 < len(tokens) else None
        row = {"function": function, "pos": pos, "token": tokens[pos]}
        row.update(compare(stream["text_logits"][logit_at[pos]].astype(np.float64), eng, eps, nxt))
        for key, value in NOT_SCORED.items():
            row.setdefault(key, value)
        rows.append(row)

    for function, start, stop in progress(runs, f"text {Path(sess.aimodelx).stem}"):
        if function == PREFILL:
            record(sess.prefill_function, stop - 1, sess.prefill_chunk(tokens[start:stop]))
        else:
            for pos in range(start, stop):
                record(sess.function, pos, sess.step(tokens[pos]))
        if stop in mine:
            k = horizons.index(stop)
            diffs, rel, scales = state_comparison(sess, reference_states(stream, "text_state_", k))
            states[str(stop)] = {n: {"max_abs_dstate": diffs[n], "max_rel_dstate": rel[n], "scale": scales[n]}
                                 for n in diffs}
    return {"rows": rows, "states": states, "tokens": len(tokens), "chunk": T, "function": sess.prefill_function,
            "decode_function": sess.function}


def text_result(parts: list[dict], horizons: list[int], thresholds: dict) -> dict:
    """The ``text`` section of the gate result from its pieces' results (:func:`text_check`): the
    rows in stream order (numbered), the states of every horizon, judged by gate_verdict.text_verdict."""
    rows = sorted((r for part in parts for r in part["rows"]), key=lambda r: r["pos"])
    rows = [{"step": i, **r} for i, r in enumerate(rows)]
    states = {int(h): named for part in parts for h, named in part["states"].items()}
    first = parts[0]
    result = text_verdict(rows, states, horizons, first["chunk"], thresholds)
    result.update({"tokens": first["tokens"], "chunk": first["chunk"], "function": first["function"],
                   "decode_function": first["decode_function"], "rows": rows})
    return result


def prompt_lengths(stream: dict) -> list[int]:
    """The gated stream's steps per prompt, in stream order."""
    prompts = stream["prompt"]
    firsts = [0] + [i for i in range(1, len(prompts)) if prompts[i] != prompts[i - 1]] + [len(prompts)]
    return [b - a for a, b in zip(firsts, firsts[1:])]


def shard_plan(stream: dict, count: int) -> list[list[dict]]:
    """The gate's work in ``count`` shards (pipeline/shards.py): pieces that are the prefill check
    or a run of one prompt's steps. One shard holds the prefill check, then every prompt."""
    return shards.plan(prompt_lengths(stream), len(stream["prefill_tokens"]), int(stream["prefill_chunk"]), count,
                       text_shape(stream))


def text_shape(stream: dict) -> tuple[int, list[int]] | None:
    """(tokens, horizons) of the reference's text stream, None where it holds none (shards.plan)."""
    if "text_tokens" not in stream:
        return None
    return len(stream["text_tokens"]), [int(h) for h in stream["text_horizons"]]


def run_piece(sess, piece: dict, stream: dict, settings: dict) -> dict | list[dict]:
    """One piece of a shard: the prefill check's result, or its decode rows."""
    eps = settings["near_tie_epsilon"]
    if piece.get(shards.PREFILL):
        return prefill_check(sess, stream, settings["thresholds"], eps)
    if piece.get(shards.TEXT):
        return text_check(sess, stream, eps, piece.get("horizons"))
    return decode_rows(sess, stream, eps, piece["start"], piece["stop"], piece["first"])


_WORKER: dict = {}  # in a gate worker process: its session, stream and settings


def _worker_init(session_factory, aimodelx: Path, export_record: dict, stream: dict, settings: dict) -> None:
    import signal

    # Ctrl-C reaches the whole process group: the stage process handles it and ends the workers
    # (an interrupted worker would print its own traceback from the pool's queue)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sess = session_factory(aimodelx, export_record)
        sess.__enter__()  # the runtime session lives as long as the worker process
    except Exception as exc:  # noqa: BLE001 - raised from the first unit, so the stage reports it as one process would
        _WORKER["error"] = exc
        return
    _WORKER.update(sess=sess, stream=stream, settings=settings)


def _worker_run(piece):
    if "error" in _WORKER:
        raise _WORKER["error"]
    return run_piece(_WORKER["sess"], piece, _WORKER["stream"], _WORKER["settings"])


def workers_granted() -> int:
    """How many processes the gate may use: the CPUs the scheduler gave this job -- SLURM's
    ``SLURM_CPUS_PER_TASK``, or Snakemake's ``threads:`` for the job, which it exports as
    ``OMP_NUM_THREADS`` -- else 1 (``dvc repro``, a stage run by hand). The rule sizes its
    threads by the model (resources.gate_threads: 1 below 0.5 B parameters)."""
    import os

    for var in ("SLURM_CPUS_PER_TASK", "OMP_NUM_THREADS"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def run_pieces(aimodelx: Path, export_record: dict, stream: dict, settings: dict, pieces: list[dict],
               session_factory=PromptSession, workers: int = 1) -> list:
    """Each piece's result (:func:`run_piece`), in order. With ``workers`` > 1 the pieces run in
    that many processes, each with its own runtime session (the Linux runtime computes on the
    calling thread, so this is how one job uses more cores); the results are the same."""
    workers = max(1, min(workers, len(pieces)))
    numpy_simd.warn_unless_recorded_kernels()  # the numbers below are the record's only on its kernels
    checks = [what for key, what in ((shards.PREFILL, "the prefill check"), (shards.TEXT, "the text stream"))
              if any(p.get(key) for p in pieces)]
    stage.log.info("gate %s: %d step(s)%s in %d process(es)", Path(aimodelx).stem, shards.steps_of(pieces),
                   "".join(f" and {c}" for c in checks), workers)
    if workers == 1:
        with session_factory(aimodelx, export_record) as sess:
            return [run_piece(sess, piece, stream, settings) for piece in pieces]
    import concurrent.futures
    import multiprocessing

    try:
        pool = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
            initargs=(session_factory, aimodelx, export_record, stream, settings))
        try:
            done = list(pool.map(_worker_run, pieces))
        except KeyboardInterrupt:  # end the workers now rather than after their current piece
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.terminate()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown()
    except concurrent.futures.process.BrokenProcessPool:
        raise PipelineError(aimodelx, f"a gate process died (killed by the system, often for memory) while "
                            f"{workers} ran at once", "give the gate more memory or fewer threads "
                            "(snakemake --set-threads gate_shard=1) and run again") from None
    return done


def with_epsilon(settings: dict, epsilon: float | None) -> dict:
    """The settings the pieces run with: the near-tie epsilon in use (gate_verdict.epsilon_used)."""
    return settings if epsilon is None else {**settings, "near_tie_epsilon": epsilon}


def gather(plan: list[list[dict]], done: list[list], export_record: dict, settings: dict,
           epsilon: float | None = None, horizons: list[int] | None = None) -> tuple[dict, list[dict]]:
    """The verdict from every shard's piece results (``done[k][i]`` is the result of
    ``plan[k][i]``): the decode rows in step order and the prefill check, judged as one gate (too
    few counted steps is judged over both together); the verdict also holds the contract, the
    prefill result, the text stream's (its pieces judged together at ``horizons``, the stream's)
    and the near-tie epsilon in use (``epsilon``; None: the configured one).
    Returns (result, the rows for the TSV)."""
    prefill, parts, rows = None, [], []
    for pieces, results in zip(plan, done):
        for piece, res in zip(pieces, results):
            if piece.get(shards.PREFILL):
                prefill = res
            elif piece.get(shards.TEXT):
                parts.append(res)
            else:
                rows.extend(res)
    rows.sort(key=lambda r: r["step"])
    text = text_result(parts, horizons, settings["thresholds"]) if parts else None
    if text is not None and settings.get("text"):
        text["file"] = settings["text"]["file"]  # what the card names
    result = verdict(rows, settings["thresholds"], counted_over=rows + prefill["rows"] + (text["rows"] if text else []))
    reasons = (contract_problems(export_record) + result["reasons"] + [f"prefill: {r}" for r in prefill["reasons"]]
               + [f"text: {r}" for r in (text["reasons"] if text else [])])
    result.update({"pass": not reasons, "reasons": reasons, "prefill": prefill, "text": text,
                   "state_writes": {fn: spec.get("state_writes") for fn, spec in export_record["functions"].items()},
                   "near_tie_epsilon": settings["near_tie_epsilon"],
                   "near_tie_epsilon_used": settings["near_tie_epsilon"] if epsilon is None else epsilon,
                   "thresholds": settings["thresholds"],
                   "prompts": settings["prompts"],
                   "shards": {"count": len(plan), "steps": [shards.steps_of(pieces) for pieces in plan],
                              "mid_prompt_starts": sum(map(shards.mid_prompt_starts, plan))}})
    for key in ("thresholds_why", "steps_why"):  # the model's own settings (config: models/<model>/gate)
        if key in settings:
            result[key] = settings[key]
    return result, rows


def run_gate(aimodelx: Path, export_record: dict, stream: dict, settings: dict,
             session_factory=PromptSession, workers: int = 1, shard_count: int = 1,
             epsilon: float | None = None) -> tuple[dict, list[dict]]:
    """The whole gate in this job: every shard of a ``shard_count`` plan, their pieces over
    ``workers`` processes, gathered. Returns (result, the decode rows for the TSV)."""
    plan = shard_plan(stream, shard_count)
    flat = [p for pieces in plan for p in pieces]
    done = iter(run_pieces(aimodelx, export_record, stream, with_epsilon(settings, epsilon), flat, session_factory,
                           workers))
    results = [[next(done) for _ in pieces] for pieces in plan]
    return gather(plan, results, export_record, settings, epsilon, (text_shape(stream) or (0, None))[1])


def check_stream(stream: dict, stream_path: Path, export_record: dict) -> None:
    """The reference holds a prefill stream made for this bundle's chunk length."""
    prefill = bundle_functions(export_record).get(PREFILL)
    if prefill is None:
        return  # PromptSession refuses such a bundle: rerun the export stage
    if "prefill_tokens" not in stream:
        raise PipelineError(stream_path, "holds no prefill stream (made before the prefill gate)",
                            "rerun the reference stage (snakemake --forcerun reference)")
    if int(stream["prefill_chunk"]) != prefill["tokens_per_call"]:
        raise PipelineError(stream_path, f"was made for prefill chunk {int(stream['prefill_chunk'])}, but the bundle's "
                            f"{prefill['name']} takes {prefill['tokens_per_call']} tokens per call",
                            "rerun the reference and export stages with the same prefill.chunk")


def check_text_stream(stream: dict, stream_path: Path, text: dict | None) -> None:
    """The reference holds the text stream the config asks for (gate/text: tokens, horizons)."""
    if text is None:
        return
    have = text_shape(stream)
    if have != (text["tokens"], [int(h) for h in text["horizons"]]):
        held = "no text stream" if have is None else f"a text stream of {have[0]} tokens, horizons {have[1]}"
        raise PipelineError(stream_path, f"holds {held}, not the {text['tokens']} tokens and horizons "
                            f"{list(text['horizons'])} gate/text asks for", "rerun the reference stage "
                            "(snakemake --forcerun reference)")


def gate_steps(stream: dict, n_prompts: int, steps: int, stream_path: Path, config_file: str | Path = "config.yaml",
               setting: str = "gate.steps") -> dict:
    """The stream with the decode steps this gate compares: each prompt's first share of
    ``steps`` -- raised to what the prompts need under this model's tokenizer where they need more
    (config.gate_step_count) -- shared by config.prompt_budgets (by the prompts' token counts where
    the reference recorded them, i.e. where some prompt needed more than its equal share;
    otherwise these are equal shares, as a reference of gate/steps holds), taken from the
    reference's stream. A prompt's steps are its tokens, then the reference's greedy continuation,
    so these are the steps a reference made for ``steps`` would hold. The prefill stream is kept
    whole. ``setting`` names where ``steps`` is set. The result also holds ``steps_used``."""
    counts = stream.get(PROMPT_TOKENS, np.zeros(n_prompts, np.int64))  # 0: not recorded, needs one step
    if len(counts) != n_prompts:
        raise PipelineError(stream_path, f"records the token counts of {len(counts)} prompts, not of the gate's "
                            f"{n_prompts}", "rerun the reference stage (snakemake --forcerun reference)")
    used = gate_step_count([int(n) for n in counts], steps)
    if used > len(stream["tokens"]):
        raise PipelineError(stream_path, f"holds {len(stream['tokens'])} steps, fewer than the {used} this gate "
                            "compares", "set the model's gate/steps for this recipe to at most gate/steps, or raise "
                            "gate/steps (the reference stage then reruns)")
    keep = []
    for i, share in enumerate(prompt_budgets([int(n) for n in counts], used, config_file, setting)):
        have = np.flatnonzero(stream["prompt"] == i)
        if len(have) < share:
            raise PipelineError(stream_path, f"holds {len(have)} step(s) of prompt {i}, fewer than the gate's share "
                                f"({share}) of {used} steps", "rerun the reference stage (snakemake --forcerun reference)")
        keep.extend(have[:share])
    return {**stream, **{key: stream[key][keep] for key in ("tokens", "prompt", "pos", "logits")},
            "steps_used": used}


def steps_fields(stream: dict, settings: dict) -> dict:
    """What the gate JSON says of its step count: the prompts' token counts where the reference
    recorded them (None: every prompt fit its equal share) and whether the configured steps were
    raised to fit the prompts (config.gate_step_count; stages/derivation.py recomputes it)."""
    counts = stream.get(PROMPT_TOKENS)
    return {"prompt_tokens": None if counts is None else [int(n) for n in counts],
            "steps_raised": stream["steps_used"] > settings["steps"]}


def bundle_digest(manifest: dict[str, dict]) -> str:
    """sha256 over a bundle's file manifest (a directory has no single file hash)."""
    import hashlib

    return hashlib.sha256(dumps_json(manifest).encode()).hexdigest()


def tsv_text(rows: list[dict]) -> str:
    def fmt(v):
        return f"{v:.6g}" if isinstance(v, float) else str(int(v) if isinstance(v, (bool, np.bool_)) else v)

    return "\t".join(TSV_COLUMNS) + "\n" + "".join("\t".join(fmt(r[c]) for c in TSV_COLUMNS) + "\n" for r in rows)


def write_report(result: dict, rows: list[dict], json_path: Path, tsv_path: Path) -> None:
    """The TSV, then the JSON sealed with the TSV's digest (pipeline/records.py: the integrity chain)."""
    import hashlib

    text = tsv_text(rows)
    with atomic_path(tsv_path) as tmp:
        tmp.write_text(text, newline="\n")
    tsv = {"name": tsv_path.name, "sha256": hashlib.sha256(text.encode()).hexdigest()}
    with atomic_path(json_path) as tmp:
        tmp.write_text(sealed_text({**result, "tsv": tsv}, "gate"), encoding="utf-8", newline="\n")


def gate_inputs(model: str, recipe: str, export_dir: Path, aot_dir: Path, stream_path: Path, settings: dict,
                config_file: str | Path = "config.yaml") -> dict:
    """What a gate shard runs and the gather judges, each checked against its stage's record:
    ``record`` (export.json), ``aimodelx`` (the lowering run), ``tested`` (the bundle's file
    manifest: the bytes tested, which the lowering must be built from), ``lowered`` (its files),
    ``stream`` (the decode steps this gate compares), ``scale`` and ``reference_steps``."""
    # export.json as the export stage sealed it; the bundle's bytes are what the gate tests and
    # records (tested_files), and must be the ones the lowering was built from
    record = read_export(export_dir, files=False)
    lowering = read_aot(aot_dir)  # checks the lowered files against aot.json
    aimodel = export_dir / record["bundle"]
    tested = tree_manifest(aimodel)
    if lowering["from"] != tested:
        raise PipelineError(aot_dir, f"was lowered from other bytes than {aimodel}",
                            "rerun the aot stage for the universal target (snakemake --forcerun aot)")
    # checked against the digest the reference stage recorded in it (a stream made by hand has
    # none: the gate records its sha256, and publish requires the digest)
    stream = read_stream(stream_path, required=False)
    check_stream(stream, stream_path, record)
    check_text_stream(stream, stream_path, settings.get("text"))
    scale = checked_logit_scale(stream, stream_path)
    setting = f"models/{model}/gate/steps/{recipe}" if "steps_why" in settings else "gate.steps"
    return {"record": record, "aimodel": aimodel, "aimodelx": aot_dir / lowering["product"], "tested": tested,
            "lowered": lowering["files"], "reference_steps": len(stream["tokens"]), "scale": scale,
            "epsilon": epsilon_used(settings["near_tie_epsilon"], scale),
            "reference_sha256": sha256_file(stream_path),
            "stream": gate_steps(stream, len(settings["prompts"]), settings["steps"], stream_path, config_file, setting)}


def tested_fields(model: str, recipe: str, inputs: dict) -> dict:
    """What a gate shard record and the gate JSON both say they tested."""
    return {"model": model, "recipe": recipe, "bundle": inputs["record"]["bundle"],
            "bundle_sha256": bundle_digest(inputs["tested"]), "lowered": inputs["aimodelx"].name,
            "tested_files": {"aimodel": inputs["tested"], "lowered": inputs["lowered"]},
            "reference_sha256": inputs["reference_sha256"]}


SHARD_STAGE = "gate_shard"  # the stage (and rule) that writes a shard record


def run_shard(model: str, recipe: str, inputs: dict, settings: dict, shard: int, count: int, out: Path,
              workers: int = 1) -> dict:
    """Shard ``shard`` of ``count``: its pieces of the plan run in the runtime, written as a sealed
    record of what was tested, the settings, its pieces and their results (no timings: a rebuild
    writes the same bytes). The verdict is the gather's (:func:`gate_bundle`)."""
    if not 0 <= shard < count:
        raise PipelineError(out, f"is shard {shard} of {count}: there is no such shard",
                            f"run shards 0..{count - 1} (--shard K --shards {count})")
    pieces = shard_plan(inputs["stream"], count)[shard]
    with gate_lowering(inputs, out) as (lowering, ran):  # gone before the record is written beside it
        results = run_pieces(lowering, inputs["record"], inputs["stream"], with_epsilon(settings, inputs["epsilon"]),
                             pieces, workers=workers)
    record = {**tested_fields(model, recipe, inputs), "shard": shard, "shards": count, "settings": settings,
              "pieces": pieces, "results": results, "lowering_run": ran, "toolchain": toolchain.versions()}
    with atomic_path(out) as tmp:
        tmp.write_text(sealed_text(record, SHARD_STAGE), encoding="utf-8", newline="\n")
    return record


def read_shards(paths: list[Path], model: str, recipe: str, inputs: dict, settings: dict) -> tuple[list, list]:
    """The shard records of this gate, in order, each checked: sealed by its stage, made for this
    bundle, lowering, reference and settings, and holding exactly its pieces of the plan for
    ``len(paths)`` shards. Returns (the plan, each shard's piece results, each shard's
    ``lowering_run``: which lowering it ran, stages/gate_lowering.py). One line naming the shard
    otherwise: a missing, stale or edited shard never counts."""
    plan = shard_plan(inputs["stream"], len(paths))
    expect = tested_fields(model, recipe, inputs)
    fix = rerun_fix(SHARD_STAGE)
    done, runs = [], []
    for k, path in enumerate(map(Path, paths)):
        rec = check_seal(path, SHARD_STAGE)
        for key, want in [*expect.items(), ("shard", k), ("shards", len(paths)), ("settings", settings),
                          ("pieces", plan[k])]:
            if rec.get(key) != want:
                what = {"bundle_sha256": "another bundle", "tested_files": "other bundle or lowering bytes",
                        "reference_sha256": "another reference stream", "settings": "other gate settings",
                        "pieces": f"other steps than shard {k} of {len(paths)} of this reference's plan",
                        "shard": f"shard {rec.get('shard')!r}, not {k}", "shards": f"{rec.get('shards')!r} shards, "
                        f"not {len(paths)}"}.get(key, f"another {key} ({rec.get(key)!r}, not {want!r})")
                raise PipelineError(path, f"is a gate shard of {what}: it was not made for this gate", fix)
        results = rec.get("results")
        if not isinstance(results, list) or len(results) != len(plan[k]):
            raise PipelineError(path, "holds no result for some of its pieces", fix)
        ran = rec.get("lowering_run")
        if not isinstance(ran, dict) or ran.get("ran") not in (PIPELINE, FOLDED):
            raise PipelineError(path, "does not say which lowering it ran (made by an older gate_shard?)", fix)
        done.append(results)
        runs.append(ran)
    return plan, done, runs


def gate_bundle(model: str, recipe: str, export_dir: Path, aot_dir: Path, stream_path: Path, settings: dict,
                json_path: Path, tsv_path: Path, workers: int = 1, config_file: str | Path = "config.yaml",
                shard_paths: list[Path] | None = None) -> dict:
    """Gate one recipe's bundle: gather the ``shard_paths`` records (the ``gate_shard`` jobs'),
    or without them run the whole gate here as one shard. The result records the sha256 of every
    file it tested (the ``.aimodel`` and the lowering it ran): publish ships those bytes and no others."""
    inputs = gate_inputs(model, recipe, export_dir, aot_dir, stream_path, settings, config_file)
    record = inputs["record"]
    if shard_paths:
        plan, done, runs = read_shards(shard_paths, model, recipe, inputs, settings)
        result, rows = gather(plan, done, record, settings, inputs["epsilon"], (text_shape(inputs["stream"]) or (0, None))[1])
    else:
        with gate_lowering(inputs, json_path) as (lowering, ran):
            result, rows = run_gate(lowering, record, inputs["stream"], settings, workers=workers,
                                    epsilon=inputs["epsilon"])
        runs = [ran]
    result["lowering_runs"] = runs
    result.update(reference_steps=inputs["reference_steps"], reference_logit_scale=inputs["scale"],
                  **steps_fields(inputs["stream"], settings))
    result.update({**tested_fields(model, recipe, inputs), "toolchain": toolchain.versions(),
                   "size_bytes": record["size_bytes"]})
    if not result["pass"]:
        failed = json_path.with_suffix(".failed.json")
        for old in (json_path, tsv_path):  # the previous verdict goes: only .failed.* is left (a hand-run gate)
            old.unlink(missing_ok=True)
        write_report(result, rows, failed, tsv_path.with_suffix(".failed.tsv"))
        raise PipelineError(json_path, f"gate FAILED for {model}/{recipe}: {'; '.join(result['reasons'])}",
                            f"inspect {failed}; the bundle is not published")
    for stale in (json_path.with_suffix(".failed.json"), tsv_path.with_suffix(".failed.tsv")):
        stale.unlink(missing_ok=True)
    write_report(result, rows, json_path, tsv_path)
    return result


def stale_report(json_path: Path) -> Path:
    """The model's build report (``results/<m>/report/index.html``, stages.report.report_path),
    which shows this gate's verdict."""
    return Path(json_path).parent.parent / "report" / "index.html"


def remove_stale_report(json_path: Path) -> None:
    """This gate's verdict is being decided again: the report that shows the old one is removed
    now, so a gate that fails, is interrupted or stops a ``--keep-going`` run never leaves a
    report saying it passed (the report rule rebuilds it once every gate has passed)."""
    report = stale_report(json_path)
    if report.is_file():
        report.unlink()
        stage.log.info("removed %s: it shows this gate's previous verdict", report)


@main_guard
def main(argv=None) -> int:
    """The gate stage: ``scripts/gate.py --model M --recipe R --export DIR --aot DIR --reference NPZ
    --json J --tsv T [--shards S0 S1 ...]``: the verdict gathered from the gate_shard
    jobs' records (the rule's form), or without them the whole gate run here; exit 1 (and no
    declared output) when the bundle fails."""
    import time

    ns = stage.parser("gate", "model", "recipe", "export", "aot", "reference", "json", "tsv",
                      optional_lists=("shards",)).parse_args(argv)
    s, _ = stage.setup("gate", ns)
    remove_stale_report(Path(ns.json))
    t0 = time.perf_counter()
    res = gate_bundle(ns.model, ns.recipe, Path(ns.export), Path(ns.aot), Path(ns.reference),
                      gate_settings(s, ns.recipe), Path(ns.json), Path(ns.tsv), workers=workers_granted(),
                      config_file=ns.config_file, shard_paths=ns.shards)
    seconds = time.perf_counter() - t0
    pre, text = res["prefill"], res.get("text")
    if text:
        stage.log.info("gate %s/%s text: %d tokens, %d positions compared, %d/%d top-1 outside near-ties, mean KL %.3g, "
                       "PPL ratio %.5f; worst state at the horizons %s", ns.model, ns.recipe, text["tokens"],
                       text["steps"], text["agree_counted"], text["counted"], text["kld_mean"], text["ppl_ratio"],
                       ", ".join(f"{h['horizon']}: {h['max_rel_dstate']:.3g}" for h in text["horizons"]))
    stage.log.info("gate %s/%s PASS: %d/%d top-1 outside %d near-ties, max|dlogits| %.3g, mean KL %.3g; prefill "
                   "(%d x %d tokens + %d through %s): %d/%d top-1, max|dlogits| %.3g, max|dstate| %.3g (%.3g relative); %.1f s, "
                   "peak RSS %.0f MB", ns.model, ns.recipe, res["agree_counted"], res["counted"], res["near_ties"],
                   res["max_abs_dlogits"], res["mean_kl"], pre["chunks"], pre["chunk"], pre["tail"],
                   pre["decode_function"], pre["agree_counted"], pre["counted"], pre["max_abs_dlogits"],
                   pre["max_abs_dstate"], pre["max_rel_dstate"], seconds, stage.rss_mb())
