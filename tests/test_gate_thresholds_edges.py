"""How stages/gate.py applies the gate's settings to a reference stream, pinned at the boundaries
(issue 34, the mutation run: docs/measurements/2026-12-06-mutation.md): the reference's logit
scale (any positive scale is accepted, the refusal's exact line), each prompt's steps, and the
steps the gate compares -- a stream holding exactly as many steps as the gate needs is enough."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from recurrent_coreai.stages import gate
from recurrent_coreai.util.errors import PipelineError

PATH = Path("stream.npz")


def test_any_positive_logit_scale_is_accepted():
    logits = np.array([[0.0, 0.5, 0.25], [1.0, 1.5, 1.25], [2.0, 2.5, 2.0]], np.float32)  # ranges 0.5 each
    assert gate.checked_logit_scale({"logits": logits}, PATH) == 0.5


def test_a_constant_reference_is_refused_in_its_exact_line():
    with pytest.raises(PipelineError) as exc:
        gate.checked_logit_scale({"logits": np.ones((3, 4), np.float32)}, PATH)
    assert str(exc.value) == ("stream.npz: has a logit scale (median max-min logit) of 0: its logits are constant or "
                              "not finite, so no top-1 pick can be compared -- fix: check the model's weights, then "
                              "rerun the reference stage (snakemake --forcerun reference)")


def test_prompt_lengths_count_a_first_prompt_of_one_step():
    assert gate.prompt_lengths({"prompt": np.array([0, 1, 1, 2])}) == [1, 2, 1]
    assert gate.prompt_lengths({"prompt": np.array([0, 0, 1])}) == [2, 1]


def _stream(per_prompt: list[int]) -> dict:
    prompt = np.repeat(np.arange(len(per_prompt)), per_prompt)
    n = len(prompt)
    return {"tokens": np.arange(n), "prompt": prompt, "pos": np.arange(n), "logits": np.zeros((n, 4), np.float32)}


def test_a_stream_of_exactly_the_steps_the_gate_compares_is_enough():
    part = gate.gate_steps(_stream([2, 2]), 2, 4, PATH)
    assert part["steps_used"] == 4 and part["prompt"].tolist() == [0, 0, 1, 1]


def test_a_stream_of_fewer_steps_is_refused_in_its_exact_line():
    with pytest.raises(PipelineError) as exc:
        gate.gate_steps(_stream([2, 1]), 2, 4, PATH)
    assert str(exc.value) == ("stream.npz: holds 3 steps, fewer than the 4 this gate compares -- fix: set the model's "
                              "gate/steps for this recipe to at most gate/steps, or raise gate/steps (the reference "
                              "stage then reruns)")


def test_token_counts_of_other_prompts_are_refused_in_their_exact_line():
    stream = {**_stream([2, 2]), gate.PROMPT_TOKENS: np.array([1, 1, 1])}
    with pytest.raises(PipelineError) as exc:
        gate.gate_steps(stream, 2, 4, PATH)
    assert str(exc.value) == ("stream.npz: records the token counts of 3 prompts, not of the gate's 2 -- fix: rerun "
                              "the reference stage (snakemake --forcerun reference)")


def test_a_plan_of_no_shards_is_refused_with_its_reason():
    from recurrent_coreai.pipeline import shards

    with pytest.raises(ValueError) as exc:
        shards.plan([3, 2], 10, 4, 0)
    assert str(exc.value) == "shards must be at least 1"
