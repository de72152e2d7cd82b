"""The gate's shards: ``gate_shard(model, recipe, k)`` jobs, each a separate job a cluster
executor can place on its own node, gathered by the ``gate`` job (stages/gate.py) into the verdict.

Shard ``k`` of ``n`` runs its pieces of the plan (pipeline/shards.py: the prefill check and runs
of decode steps, a run that starts mid-prompt fed its prompt's earlier tokens through the
bundle's own prefill and decode first) in the Core AI runtime and writes a sealed record: what it
tested (the bundle's and the lowering's file digests, the reference stream's), the settings, its
pieces and their compared rows. It judges nothing: a failing step is the gather's to count.

``--shard`` and ``--shards`` are checked (integers, ``0 <= k < n``, no more shards than the
gate's steps and its prefill check can fill) before anything is removed or written: a bad
command line leaves the model's report and every output as they were.
"""

from __future__ import annotations

from pathlib import Path

from recurrent_coreai.pipeline import shards, stage
from recurrent_coreai.pipeline.config import gate_settings
from recurrent_coreai.stages.gate import (SHARD_STAGE, gate_inputs, remove_stale_report, run_shard, shard_plan, text_shape,
                                          workers_granted)
from recurrent_coreai.util.errors import PipelineError, main_guard


def shard_numbers(shard: str, count: str, out: Path) -> tuple[int, int]:
    """``--shard K --shards N`` as integers with ``0 <= K < N``; else one line at ``out``."""
    try:
        k, n = int(shard), int(count)
    except ValueError:
        raise PipelineError(out, f"--shard {shard!r} --shards {count!r}: not whole numbers",
                            "give --shard K --shards N with 0 <= K < N") from None
    if n < 1 or not 0 <= k < n:
        raise PipelineError(out, f"is shard {k} of {n}: there is no such shard",
                            f"run shards 0..{n - 1} (--shard K --shards {n})" if n >= 1
                            else "give --shards at least 1 (--shard K --shards N with 0 <= K < N)")
    return k, n


def check_plan(stream: dict, count: int, out: Path) -> None:
    """``count`` shards fit this gate's stream (each needs a step or the prefill check); else one line."""
    try:
        shard_plan(stream, count)
    except ValueError as exc:
        text = text_shape(stream)
        most = 1 + len(stream["prompt"]) + (len(text[1]) if text else 0)  # a shard per step and per check piece
        raise PipelineError(out, f"--shards {count}: {exc}", f"use at most {most} shards (the gate's steps, its "
                            "prefill check and its text stream's horizons); the rule sizes them from "
                            "gate.shard_seconds") from None


@main_guard
def main(argv=None) -> int:
    """``scripts/gate_shard.py --model M --recipe R --shard K --shards N --export DIR --aot DIR
    --reference NPZ --out JSON``."""
    import time

    ns = stage.parser(SHARD_STAGE, "model", "recipe", "shard", "shards", "export", "aot", "reference",
                      "out").parse_args(argv)
    out = Path(ns.out)
    shard, count = shard_numbers(ns.shard, ns.shards, out)  # before anything is removed
    s, _ = stage.setup(SHARD_STAGE, ns)
    settings = gate_settings(s, ns.recipe)
    t0, cpu0 = time.perf_counter(), time.process_time()
    inputs = gate_inputs(ns.model, ns.recipe, Path(ns.export), Path(ns.aot), Path(ns.reference), settings,
                         ns.config_file)
    check_plan(inputs["stream"], count, out)
    # the gate's verdict is being decided again: its report goes now (out is gate/<recipe>/shard-K.json)
    remove_stale_report(out.parent.with_suffix(".json"))
    rec = run_shard(ns.model, ns.recipe, inputs, settings, shard, count, out, workers_granted())
    stage.log.info("gate shard %s/%s %d/%d: %d step(s)%s, %d piece(s) starting mid-prompt; %.1f s wall, %.1f s CPU "
                   "(this process), peak RSS %.0f MB", ns.model, ns.recipe, rec["shard"], rec["shards"],
                   shards.steps_of(rec["pieces"]),
                   "".join(f" and {what}" for key, what in ((shards.PREFILL, "the prefill check"),
                                                            (shards.TEXT, "the text stream"))
                           if any(p.get(key) for p in rec["pieces"])),
                   shards.mid_prompt_starts(rec["pieces"]),
                   time.perf_counter() - t0, time.process_time() - cpu0, stage.rss_mb())
    return 0
