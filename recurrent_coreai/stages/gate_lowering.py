"""Which lowering of the shipped bundle a gate runs: the aot stage's, or the same program with the
work the Linux runtime repeats on its constant weights done once (coreai/constant_fold.py: a
quantised bundle's dequantisation; an fp32 bundle's matmuls by a large constant, on that constant
stored transposed; an fp16 bundle's 1 x 1 convolutions by one, as fp32 matmuls on it widened and
stored transposed) -- trusted only after it agrees with the aot stage's lowering bit for bit.

The Linux runtime dequantises every int8 weight on every call (~75% of an int8 decode call; at
1.5B ~40 s a call against fp16's ~7.5 s), its kernel for a 65536-row fp32 head times a vector
takes 29-32 ms where the transposed form takes 4.4-8.5 ms, and its fp16 1 x 1 convolution of that
head 42-59 ms where the fp32 matmul rounded once takes 4.9 ms. Folding reads nothing but the shipped
``main.mlirb``. Before a single step is compared, one prefill chunk and :data:`FOLD_CHECK_DECODE`
decode calls of the reference's prefill stream run through both lowerings from zero states; every
logits vector and every state (after the chunk and at the end) must be equal bit for bit. Any
difference, or a bundle the fold cannot read, and the gate runs the aot stage's lowering instead,
saying why in its record; a bundle with nothing to fold runs it without a word.
The folded lowering is a scratch directory beside the gate's output, removed when the gate ends
(or by the next run after a kill: ``fsutil.remove_stale_temps``); it is never published.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

from recurrent_coreai.coreai.constant_fold import NothingToFold, fold_constants
from recurrent_coreai.coreai.runtime import PromptSession
from recurrent_coreai.pipeline import stage
from recurrent_coreai.util.fsutil import sha256_file

FOLD_CHECK_DECODE = 2  # decode calls after one prefill chunk, compared bit for bit (at 1.5B int8: ~40 s each)
PIPELINE, FOLDED = "aot stage's", "constants folded once"


def _calls(lowering: Path, record: dict, tokens: list[int], session_factory) -> tuple[list, list]:
    """The check's logits, and the states after the prefill chunk and at the end."""
    with session_factory(lowering, record) as sess:
        logits = [sess.prefill_chunk(tokens[:sess.chunk])]
        states = [sess.state_arrays()]
        logits += [sess.step(t) for t in tokens[sess.chunk:sess.chunk + FOLD_CHECK_DECODE]]
        states.append(sess.state_arrays())
    return logits, states


def first_difference(shipped: Path, folded: Path, record: dict, tokens: list[int],
                     session_factory=PromptSession) -> str | None:
    """None when both lowerings give the same bits on the check's calls; else what differs first."""
    (a_logits, a_states), (b_logits, b_states) = (_calls(x, record, tokens, session_factory) for x in (shipped, folded))
    for i, (a, b) in enumerate(zip(a_logits, b_logits)):
        if a.tobytes() != b.tobytes():
            return (f"call {i + 1} of {len(a_logits)}: logits differ (max |Δ| {float(np.max(np.abs(a - b))):.3g}, "
                    f"top-1 {int(np.argmax(a))} vs {int(np.argmax(b))})")
    for when, a, b in (("after the prefill chunk", a_states[0], b_states[0]), ("at the end", a_states[1], b_states[1])):
        for name in a:
            if a[name].tobytes() != b[name].tobytes():
                return f"state {name} {when} differs"
    return None


@contextlib.contextmanager
def gate_lowering(inputs: dict, near: Path, session_factory=PromptSession) -> Iterator[tuple[Path, dict]]:
    """(the lowering to run, what the gate's record says of it). ``inputs`` as
    ``stages.gate.gate_inputs`` returns them; ``near`` is the gate's output (the scratch
    directory goes beside it, named as its temporaries are)."""
    shipped, record = inputs["aimodelx"], inputs["record"]
    near = Path(near)
    near.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{near.name}.", suffix=".tmp", dir=near.parent) as tmp:
        folded = Path(tmp) / shipped.name
        folded.mkdir()
        tokens = [int(t) for t in inputs["stream"]["prefill_tokens"]]
        info, why = None, None
        try:
            info = fold_constants(inputs["aimodel"], folded)
            why = first_difference(shipped, folded, record, tokens, session_factory)
        except NothingToFold:  # the aot stage's lowering is all there is to run
            pass
        except Exception as exc:  # noqa: BLE001 - any failure means: run what the aot stage lowered
            why = f"the fold failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        if info is None and why is None:
            yield shipped, {"ran": PIPELINE}
            return
        if why is None:
            yield folded, {"ran": FOLDED, **info, "checked_calls": 1 + FOLD_CHECK_DECODE, "bit_identical": True,
                           "odix_sha256": sha256_file(folded / "main-universal.odix")}
            return
    stage.log.warning("gate %s: running the aot stage's lowering, not the folded one: %s", shipped.stem, why)
    yield shipped, {"ran": PIPELINE, "fold_refused": why}
