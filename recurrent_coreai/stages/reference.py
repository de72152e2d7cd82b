"""The reference stage: the gate's teacher-forced token streams and the fp32 reference's outputs.

1. Per prompt: the tokenizer kind's chat prompt (World: token 0, then ``User: {prompt}\n\nAssistant:``),
   extended by the fp32
   reference's greedy continuation up to the prompt's share of ``gate.steps``
   (config.prompt_budgets: equal shares, or a long prompt's tokens plus one generated step); the
   reference logits at every step (keys ``tokens``, ``prompt``, ``pos``, ``logits``; and
   ``prompt_tokens``, each prompt's token count, only where the shares are not the equal ones).
2. The prefill stream (keys ``prefill_*``): those per-prompt streams back to back, repeated up to
   ``prefill.gate_tokens`` tokens (default 2*chunk+5, so two full chunks and a tail), fed to the
   reference continuously (no reset). Stored: the logits at every position where the bundle
   reports some (each full chunk's last token, every tail token) and the reference's states, in
   the bundle's layout, after each full chunk and at the end. The per-prompt streams are shorter
   than a chunk; this one makes the gate actually run ``prefill``.

Computed once per model; every recipe's gate feeds the SAME streams to the Core AI runtime.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from recurrent_coreai import families, tokenizers
from recurrent_coreai.checkpoints.reader import load_checkpoint
from recurrent_coreai.coreai.entrypoints import split_prompt, text_logit_positions
from recurrent_coreai.pipeline import stage
from recurrent_coreai.pipeline.config import gate_step_count, origin, prefill_length, prompt_budgets, text_settings
from recurrent_coreai.pipeline.records import PROMPT_TOKENS, STREAM_SEAL, read_manifest, read_vocab, stream_digest
from recurrent_coreai.stages import text_chunked
from recurrent_coreai.stages.model_source import family_and_source
from recurrent_coreai.util.errors import PipelineError, main_guard
from recurrent_coreai.util.fsutil import atomic_path


def prefill_stream(ref, tokens: np.ndarray, chunk: int, n: int) -> dict:
    """``tokens`` repeated to ``n``, fed to ``ref`` from zero states without a reset; the logits at
    each full chunk's last position and at every tail position, the states after each full chunk
    and at the end. Arrays for ``np.savez`` (keys ``prefill_*``)."""
    stream = np.resize(np.asarray(tokens, np.int64), n)
    full = split_prompt(n, chunk)[0] * chunk
    state = ref.zero_state()
    logit_pos, logits, state_pos, states = [], [], [], {}
    for p, tok in enumerate(stream):
        x = ref.advance(int(tok), state)  # the head only where the bundle reports logits
        chunk_end = p + 1 <= full and (p + 1) % chunk == 0
        if chunk_end or p >= full:
            logit_pos.append(p)
            logits.append(ref.logits(x).numpy().astype(np.float32))
        if chunk_end or p + 1 == n:
            state_pos.append(p + 1)
            for name, arr in ref.bundle_states(state).items():
                states.setdefault(name, []).append(arr)
    out = {"prefill_tokens": stream, "prefill_chunk": np.array(chunk, np.int64),
           "prefill_logit_pos": np.array(logit_pos, np.int64), "prefill_logits": np.stack(logits),
           "prefill_state_pos": np.array(state_pos, np.int64)}
    out.update({f"prefill_state_{name}": np.stack(v) for name, v in states.items()})
    return out


def text_tokens(tok, text: dict, config_file: str | Path = "config.yaml") -> np.ndarray:
    """The first ``text["tokens"]`` tokens of the held-out text under this model's tokenizer, as a
    document (its start token, then the raw text: ``tok.prompt(text, chat=False)``); one line when
    the file is missing, not UTF-8 or too short for this tokenizer."""
    path = Path(text["file"])
    try:
        body = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise PipelineError(path, "is missing (gate.text.file)", f"restore it (git checkout -- {path}) or point "
                            f"gate.text.file in {config_file} at a UTF-8 text file") from None
    except UnicodeDecodeError as exc:
        raise PipelineError(path, f"is not UTF-8 text (byte {exc.start})", "save it as UTF-8") from None
    ids = tok.prompt(body, chat=False)
    if len(ids) < text["tokens"]:
        raise PipelineError(path, f"holds {len(ids)} tokens under this model's tokenizer, fewer than gate.text.tokens "
                            f"{text['tokens']}", f"use a longer text, or lower gate.text.tokens in {config_file} "
                            "(and its horizons)")
    return np.asarray(ids[:text["tokens"]], np.int64)


def text_stream(ref, tokens: np.ndarray, chunk: int, horizons: list[int]) -> dict:
    """The held-out text through ``ref`` from zero states: the logits where the bundle reports
    them (:func:`text_logit_positions`) and every state at each horizon. Arrays for ``np.savez``
    (keys ``text_*``)."""
    n = len(tokens)
    want, at_horizon = set(text_logit_positions(n, chunk, horizons)), set(horizons)
    state = ref.zero_state()
    logit_pos, logits, states = [], [], {}
    for p, tok in enumerate(tokens):
        x = ref.advance(int(tok), state)  # the head (most of a step at a large vocabulary) only where scored
        if p in want:
            logit_pos.append(p)
            logits.append(ref.logits(x).numpy().astype(np.float32))
        if p + 1 in at_horizon:
            for name, arr in ref.bundle_states(state).items():
                states.setdefault(name, []).append(arr)
    out = {"text_tokens": np.asarray(tokens, np.int64), "text_horizons": np.array(horizons, np.int64),
           "text_logit_pos": np.array(logit_pos, np.int64), "text_logits": np.stack(logits)}
    out.update({f"text_state_{name}": np.stack(v) for name, v in states.items()})
    return out


def reference_stream(family, source_dir: Path, tok, prompts: list[str], steps: int,
                     config_file: str = "config.yaml", prefill: dict | None = None, text: dict | None = None,
                     chunked: dict | None = None) -> dict:
    """Token streams and fp32 reference outputs; arrays for ``np.savez``. ``family``: the model's
    family; ``tok``: its tokenizer (the chat prompt format is the tokenizer kind's); ``prefill``:
    the config's ``prefill`` section (chunk, gate_tokens), for the prefill stream; ``text``:
    config.text_settings (the long held-out text stream), None for none; ``chunked``: the config's
    ``reference.chunked`` (from_params and the check's limits): a model of at least ``from_params``
    parameters runs the text stream in the family's chunked fp32 form, checked against this
    reference first (stages/text_chunked.py); None: token by token whatever the size."""
    geom, weights = load_checkpoint(source_dir, family=family)
    ref = family.reference(weights, geom, torch.float32)
    tokens, prompt_idx, positions, logits = [], [], [], []
    streams = [tok.prompt(prompt) for prompt in prompts]
    lengths = [len(s) for s in streams]
    budgets = prompt_budgets(lengths, gate_step_count(lengths, steps), config_file)
    for i, (stream, budget) in enumerate(zip(streams, budgets)):
        state = ref.zero_state()
        for pos in range(budget):
            out = ref.step(stream[pos], state)
            logits.append(out.numpy().astype(np.float32))
            tokens.append(stream[pos]); prompt_idx.append(i); positions.append(pos)
            if pos + 1 == len(stream) and len(stream) < budget:
                stream.append(int(torch.argmax(out)))  # reference greedy continuation
    out = {"tokens": np.array(tokens, np.int64), "prompt": np.array(prompt_idx, np.int64),
           "pos": np.array(positions, np.int64), "logits": np.stack(logits)}
    if budgets != prompt_budgets([0] * len(prompts), steps, config_file):
        # some prompt needed more than its equal share: the gate needs the token counts to share
        # fewer steps the same way (absent, the stream is the equal shares' as it always was)
        out[PROMPT_TOKENS] = np.array(lengths, np.int64)
    if prefill is not None:
        out.update(prefill_stream(ref, out["tokens"], prefill["chunk"], prefill_length(prefill, config_file)))
    if text is not None:
        toks, chunk, horizons = text_tokens(tok, text, config_file), prefill["chunk"], text["horizons"]
        # the family's count, as pipeline/resources.py sizes this job by (a tied head once)
        if chunked is not None and family.parameter_count(geom) >= chunked["from_params"]:
            first = text_stream(ref, toks[:horizons[0]], chunk, horizons[:1])
            out.update(text_chunked.checked(family, weights, geom, toks, chunk, horizons, chunked, first,
                                            str(source_dir)))
        else:
            out.update(text_stream(ref, toks, chunk, horizons))
    return out


def check_finite(stream: dict, source_uri: str, prompts: list[str]) -> None:
    """The reference's logits and states are finite: weights that are finite themselves can still
    make the recurrence overflow (e.g. a decay exponent of 100). One line naming the model's own
    source and where the stream first went inf or NaN; nothing is written."""
    for key in ("logits", "prefill_logits", "text_logits"):
        bad = np.flatnonzero(~np.isfinite(stream[key]).all(axis=1)) if key in stream else []
        if len(bad):
            at = (f"step {int(bad[0])} (prompt {int(stream['prompt'][bad[0]])}: {prompts[int(stream['prompt'][bad[0]])]!r})"
                  if key == "logits" else f"{key.split('_')[0]} position {int(stream[key.split('_')[0] + '_logit_pos'][bad[0]])}")
            raise PipelineError(source_uri, f"the fp32 reference's logits are not finite (inf or NaN) from {at} on: "
                                "these weights make the recurrence overflow", "check the checkpoint's weights (a "
                                "decay, A_log or dt_bias far out of range, a wrong sign); nothing was gated")
    for key, arr in stream.items():
        state = key.startswith(("prefill_state_", "text_state_")) and key != "prefill_state_pos"
        if state and not np.isfinite(arr).all():
            raise PipelineError(source_uri, f"the fp32 reference's state {key.split('_state_', 1)[1]} is not finite "
                                "(inf or NaN): these weights make the recurrence overflow",
                                "check the checkpoint's weights; nothing was gated")


@main_guard
def main(argv=None) -> int:
    """``scripts/reference.py --model M --source DIR --vocab DIR --out stream.npz``."""
    ns = stage.parser("reference", "model", "source", "vocab", "out").parse_args(argv)
    s, cfg = stage.setup("reference", ns)
    t0 = time.perf_counter()
    family, source = family_and_source(s, ns.model, ns.source)
    read_vocab(Path(ns.vocab))  # the bytes the vocab stage recorded
    tok = tokenizers.kind(families.tokenizer_of(s["models"][ns.model])).load(Path(ns.vocab))
    stream = reference_stream(family, source, tok, s["gate"]["prompts"], s["gate"]["steps"],
                              origin(cfg), s["prefill"], text_settings(s["gate"], s["prefill"]["chunk"], origin(cfg)),
                              s.get("reference", {}).get("chunked"))
    check_finite(stream, read_manifest(source, files=False)["source"]["uri"], s["gate"]["prompts"])
    with atomic_path(ns.out) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, **stream, **{STREAM_SEAL: np.array(stream_digest(stream))})  # sealed: pipeline/records.py
    top2 = np.sort(stream["logits"], axis=1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    stage.log.info("reference %s: %d steps + a %d-token prefill stream (chunk %d) + a %d-token text stream in %.1f s; "
                   "logit max %.2f; top-2 margin median %.3f, min %.3f", ns.model, len(stream["tokens"]),
                   len(stream["prefill_tokens"]), int(stream["prefill_chunk"]), len(stream.get("text_tokens", ())),
                   time.perf_counter() - t0, float(stream["logits"].max()),
                   float(np.median(margins)), float(margins.min()))
