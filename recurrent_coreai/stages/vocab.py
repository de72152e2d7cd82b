"""The vocab stage: the tokenizer files a device app needs, made and verified by the model's
tokenizer kind (``families.tokenizer_of``: ``models.<m>.tokenizer``, else the family's; its
``bake_stage``) into ``results/<m>/vocab/``. The kind's settings: config.yaml ``vocab:`` and the
model's ``tokenizer_eos`` (read by the bytes kind)."""

from __future__ import annotations

from pathlib import Path

from recurrent_coreai import families, tokenizers
from recurrent_coreai.pipeline import stage
from recurrent_coreai.pipeline.records import write_vocab_record
from recurrent_coreai.stages.model_source import family_and_source
from recurrent_coreai.util.errors import main_guard


@main_guard
def main(argv=None) -> int:
    """``scripts/vocab.py --model M --source DIR --out DIR``."""
    ns = stage.parser("vocab", "model", "source", "out").parse_args(argv)
    s, _ = stage.setup("vocab", ns)
    _, source = family_and_source(s, ns.model, ns.source)  # the source's bytes, as its stage recorded them
    model = s["models"][ns.model]
    kind = families.tokenizer_of(model)
    settings = {**s["vocab"], tokenizers.EOS_KEY: model.get(tokenizers.EOS_KEY)}
    report = tokenizers.kind(kind).bake_stage(source, Path(ns.out), settings)
    write_vocab_record(Path(ns.out))  # the digest of every file it wrote (pipeline/records.py)
    stage.log.info("vocab %s (%s): %s -> %s", ns.model, kind, report["summary"], ns.out)
