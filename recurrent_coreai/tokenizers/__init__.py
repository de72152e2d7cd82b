"""Tokenizer kinds, chosen by a family's ``tokenizer`` attribute: ``world`` (RWKV World trie) and
``hf-bpe`` (a Hugging Face byte-level BPE ``tokenizer.json``).

Each kind module gives: ``bake_stage(source_dir, out_dir, settings)`` (the vocab stage), ``load(vocab_dir)``
(a tokenizer with ``encode``, ``token_bytes``, ``eos``, ``prompt(text, chat)``), ``source_files`` (a
synthetic source's tokenizer files), ``carry`` (a checkpoint's), and ``DESCRIPTION`` /
``CHAT_DESCRIPTION`` for the card and the catalog. The chat format lives in the kind, once.
"""

from __future__ import annotations

import importlib

from recurrent_coreai.util.errors import PipelineError

KINDS = {"world": "world", "hf-bpe": "bpe"}


def kind(name: str):
    """The module of tokenizer kind ``name``."""
    if name not in KINDS:
        raise PipelineError(f"tokenizer kind {name!r}", "is not known", f"use one of {', '.join(KINDS)}")
    return importlib.import_module(f"{__name__}.{KINDS[name]}")
