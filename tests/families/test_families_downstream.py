"""Every family through what comes after the export, without family code in it: on the tree the
tests' `snakemake --cores 1 publish` built (all three tiny families: tests/conftest.py
``tiny_results``), `generate`'s greedy continuation in the Core AI runtime equals the family's own
fp32 reference token for token, and the card, the catalog's io contract and status describe each
family's states and tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recurrent_coreai import families, tokenizers
from recurrent_coreai.checkpoints.reader import load_checkpoint
from recurrent_coreai.pipeline import records
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.tools.generate import generate, open_bundle
from recurrent_coreai.tools.sampling import Sampler, Sampling

RESULTS = None  # the built tree (conftest fills it in)
MODELS = {"rwkv6-tiny": "rwkv6", "mamba2-tiny": "mamba2"}
N_NEW = 12


@pytest.mark.parametrize("model", sorted(MODELS))
def test_greedy_generate_equals_the_reference(model):
    family = families.get(MODELS[model])
    lay = Layout(RESULTS, model)
    session, tok = open_bundle(RESULTS, model, "fp32", tokenizer_kind=family.tokenizer)
    prompt = tok.prompt("Hello, who are you?")
    with session:
        res = generate(session, tok, prompt, Sampler(Sampling()), N_NEW)
    geom, weights = load_checkpoint(lay.source, family=family)
    want = family.reference(weights, geom, torch.float32).greedy(prompt, N_NEW, stop=tok.eos)
    got = res.tokens + ([tok.eos] if res.stop_reason == "eos" else [])
    assert got == want[:len(got)] and len(got) == len(want), (got, want)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_card_and_the_records_describe_the_family(model):
    family = families.get(MODELS[model])
    lay = Layout(RESULTS, model)
    card = lay.card.read_text(encoding="utf-8")
    export = json.loads((lay.export("fp32") / "export.json").read_text())
    geom = family.geometry_from_dict(export["geometry"])
    for spec in family.state_specs(geom):
        assert f"| `{spec.name}` | {list(spec.shape)} | {spec.meaning} |" in card
        assert export["states"][spec.name] == list(spec.shape)
    assert tokenizers.kind(family.tokenizer).DESCRIPTION in card
    assert family.card_summary.split(". ")[0] in card
    for tag in family.tags:
        assert f"- {tag}" in card
    why = " ".join(json.loads((lay.export("int8keepstate") / "export.json").read_text())["recipe_spec"]["why"].split())
    assert f"Why this choice: {why}" in card  # the recipe's measured reason, in one sentence
    published = records.vocab_files(lay.vocab)  # the tokenizer files (not the vocab stage's own record)
    receipt = json.loads((lay.publish / "publish.json").read_text())
    assert receipt["family"] == family.name and receipt["tokenizer_files"] == published
    assert all(f"universal/{model}-fp32/{name}" in receipt["files"] for name in published)
