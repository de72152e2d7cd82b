"""The toolchain stage: the versions that shape a bundle, in ``results/toolchain.json``."""

from __future__ import annotations

from recurrent_coreai.coreai.toolchain import record
from recurrent_coreai.util.errors import main_guard


@main_guard
def main(argv=None) -> int:
    """The toolchain stage: ``scripts/toolchain.py --out results/toolchain.json``."""
    import json

    from recurrent_coreai.pipeline import stage
    from recurrent_coreai.pipeline.records import sealed_text
    from recurrent_coreai.util.fsutil import write_text_atomic

    ns = stage.parser("toolchain", "out").parse_args(argv)
    stage.setup("toolchain", ns)
    rec = record()
    write_text_atomic(ns.out, sealed_text(rec, "toolchain"))  # sealed: see pipeline/records.py
    stage.log.info("toolchain: %s", json.dumps(rec, sort_keys=True))
