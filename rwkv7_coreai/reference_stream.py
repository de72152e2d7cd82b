"""The reference stage: the gate's teacher-forced token stream and the fp32 reference's logits.

For every prompt: token 0, then ``User: {prompt}\n\nAssistant:``, extended by the fp32
reference's greedy continuation up to the prompt's share of ``gate.steps``. Computed once per
model; every recipe's gate feeds the SAME stream to the Core AI runtime and compares.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from . import stage
from .checkpoint import load_checkpoint
from .config import origin
from .errors import PipelineError, main_guard
from .fsutil import atomic_path
from .reference import Reference
from .tokenizer import TrieTokenizer
from .vocab import read_tsv

CHAT = "User: {prompt}\n\nAssistant:"
EOS = 0


def budgets(n_prompts: int, steps: int) -> list[int]:
    base, extra = divmod(steps, n_prompts)
    return [base + (1 if i < extra else 0) for i in range(n_prompts)]


def reference_stream(source_dir: Path, vocab: dict[int, bytes], prompts: list[str], steps: int,
                     config_file: str = "config.yaml") -> dict:
    """Token stream and fp32 reference logits; arrays for ``np.savez``."""
    geom, weights = load_checkpoint(source_dir)
    ref = Reference(weights, geom, torch.float32)
    tok = TrieTokenizer(vocab)
    tokens, prompt_idx, positions, logits = [], [], [], []
    for i, (prompt, budget) in enumerate(zip(prompts, budgets(len(prompts), steps))):
        stream = [EOS] + tok.encode(CHAT.format(prompt=prompt))
        if len(stream) > budget:
            raise PipelineError(config_file, f"prompt {i} is {len(stream)} tokens, more than its share "
                                f"({budget}) of gate.steps={steps}", "raise gate.steps or shorten the prompt")
        state = ref.zero_state()
        for pos in range(budget):
            out = ref.step(stream[pos], state)
            logits.append(out.numpy().astype(np.float32))
            tokens.append(stream[pos]); prompt_idx.append(i); positions.append(pos)
            if pos + 1 == len(stream) and len(stream) < budget:
                stream.append(int(torch.argmax(out)))  # reference greedy continuation
    return {"tokens": np.array(tokens, np.int64), "prompt": np.array(prompt_idx, np.int64),
            "pos": np.array(positions, np.int64), "logits": np.stack(logits)}


@main_guard
def main(argv=None) -> int:
    """``scripts/reference.py --model M --source DIR --vocab TSV --out stream.npz``."""
    ns = stage.parser("reference", "model", "source", "vocab", "out").parse_args(argv)
    s, cfg = stage.setup("reference", ns)
    t0 = time.perf_counter()
    stream = reference_stream(Path(ns.source), read_tsv(Path(ns.vocab)), s["gate"]["prompts"], s["gate"]["steps"],
                              origin(cfg))
    with atomic_path(ns.out) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, **stream)
    top2 = np.sort(stream["logits"], axis=1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    stage.log.info("reference %s: %d steps in %.1f s; logit max %.2f; top-2 margin median %.3f, min %.3f", ns.model,
                   len(stream["tokens"]), time.perf_counter() - t0, float(stream["logits"].max()),
                   float(np.median(margins)), float(margins.min()))
