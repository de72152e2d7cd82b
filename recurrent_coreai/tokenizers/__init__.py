"""Tokenizer kinds, chosen per model: config.yaml ``models.<m>.tokenizer``, by default the family's
``tokenizer`` attribute (``families.tokenizer_of`` resolves it, for every caller): ``world`` (RWKV
World trie), ``hf-bpe`` (a Hugging Face byte-level BPE ``tokenizer.json``, GPT-2 / GPT-NeoX style:
bpe.py), ``sp-bpe`` (a SentencePiece-style BPE ``tokenizer.json`` with byte fallback, Llama /
Mistral style: spbpe.py) and ``bytes`` (256 ids, id = byte value, an optional configured end of
text: bytes.py).

Each kind module gives: ``bake_stage(source_dir, out_dir, settings)`` (the vocab stage), ``load(vocab_dir)``
(a tokenizer with ``encode``, ``token_bytes``, ``eos``, ``n_ids``, ``prompt(text, chat)``), ``source_files`` (a
synthetic source's tokenizer files), ``carry`` (a checkpoint's), ``fits(source_dir, settings, rows,
where)`` (every id the tokenizer produces has a row in the model: ``fit.py``; returns the number of
ids), ``MIN_VOCAB`` (the smallest synthetic ``shape.vocab`` its ids fit in: the config check; the
BPE kinds' ids are their files', checked by ``fits``), and ``DESCRIPTION`` /
``CHAT_DESCRIPTION`` for the card and the catalog. The chat format lives in the kind, once. The BPE
kinds read their end-of-text and first tokens from the checkpoint's ``tokenizer_config.json`` (the
kind's constants are the defaults): their loaded tokenizer's ``chat_description`` (and, sp-bpe,
``card_eos``) state this model's, and the card takes them from it.
"""

from __future__ import annotations

import importlib

from recurrent_coreai.util.errors import PipelineError

KINDS = {"world": "world", "hf-bpe": "bpe", "sp-bpe": "spbpe", "bytes": "bytes"}
# The settings key of a checkpoint's pinned tokenizer file (config.yaml models.<m>.source.tokenizer_sha256;
# the source stage passes it with vocab:). The World vocabulary is pinned by vocab.sha256 instead.
PIN = "tokenizer_sha256"
# The settings key of a model's configured end-of-text id (config.yaml models.<m>.tokenizer_eos; the
# stages pass it with vocab:). Only the bytes kind reads it; the config refuses it for another kind.
EOS_KEY = "tokenizer_eos"


def kind(name: str):
    """The module of tokenizer kind ``name``."""
    if name not in KINDS:
        raise PipelineError(f"tokenizer kind {name!r}", "is not known", f"use one of {', '.join(KINDS)}")
    return importlib.import_module(f"{__name__}.{KINDS[name]}")
