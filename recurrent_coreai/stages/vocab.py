"""The vocab stage: bake the pinned World vocab to the device TSV and verify it (tokenizers.world)."""

from __future__ import annotations

from pathlib import Path

from recurrent_coreai.pipeline import stage
from recurrent_coreai.tokenizers.world import VOCAB_FILE, bake, check_checkpoint_vocab, package_vocab
from recurrent_coreai.util.errors import main_guard


@main_guard
def main(argv=None) -> int:
    """The vocab stage: bake the pinned World vocab to ``rwkv_vocab.tsv`` and verify it."""
    import pyrwkv_tokenizer


    ns = stage.parser("vocab", "model", "source", "out").parse_args(argv)
    s, _ = stage.setup("vocab", ns)
    vc = s["vocab"]
    original = package_vocab(vc["package"], vc["version"], vc["file"], vc["sha256"])
    shipped = Path(ns.source) / VOCAB_FILE
    if shipped.is_file():
        check_checkpoint_vocab(shipped, original)
    report = bake(original, Path(ns.out), official=pyrwkv_tokenizer.RWKVTokenizer())
    stage.log.info("vocab %s: %d entries baked to %s; corpus of %d checked (%d also against pyrwkv_tokenizer)",
                   ns.model, report["entries"], ns.out, report["corpus"], report["checked_official"])
