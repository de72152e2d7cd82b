"""The vocab stage: the tokenizer files a device app needs, made and verified by the model's
tokenizer kind (``tokenizers.kind(family.tokenizer).bake_stage``) into ``results/<m>/vocab/``."""

from __future__ import annotations

from pathlib import Path

from recurrent_coreai import families, tokenizers
from recurrent_coreai.pipeline import stage
from recurrent_coreai.util.errors import main_guard


@main_guard
def main(argv=None) -> int:
    """``scripts/vocab.py --model M --source DIR --out DIR``."""
    ns = stage.parser("vocab", "model", "source", "out").parse_args(argv)
    s, _ = stage.setup("vocab", ns)
    family = families.get(s["models"][ns.model]["family"])
    report = tokenizers.kind(family.tokenizer).bake_stage(Path(ns.source), Path(ns.out), s["vocab"])
    stage.log.info("vocab %s (%s): %s -> %s", ns.model, family.tokenizer, report["summary"], ns.out)
