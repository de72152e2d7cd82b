#!/usr/bin/env python3
"""Pin an hf source to the full commit hash its branch points at now (needs the Hub).

    python scripts/pin_revision.py rwkv7-goose-1.5b [--branch main] [--config-file config.yaml]
"""
import argparse
import re
import sys
from pathlib import Path

from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.util.errors import PipelineError, main_guard


@main_guard
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--branch", default="main")
    ap.add_argument("--config-file", default="config.yaml")
    ns = ap.parse_args()
    cfg = cfgmod.load(ns.config_file)
    src = cfgmod.model(cfg, ns.model)["source"]
    if src["kind"] != "hf":
        raise PipelineError(ns.config_file, f"model {ns.model} has a {src['kind']} source", "only hf sources are pinned")
    from huggingface_hub import HfApi

    sha = HfApi().model_info(src["repo"], revision=ns.branch).sha
    path = Path(ns.config_file)
    text = path.read_text()
    block = re.search(rf"(?ms)^  {re.escape(ns.model)}:\n.*?(?=^  \S|\Z)", text)
    new_block, n = re.subn(r'(revision:\s*)"?[^"\n]*"?', rf'\g<1>"{sha}"', block.group(0), count=1)
    if n != 1:
        raise PipelineError(path, f"no revision line for {ns.model}", "add `revision:` under its source")
    path.write_text(text[:block.start()] + new_block + text[block.end():])
    print(f"{ns.model}: {src['repo']}@{ns.branch} pinned to {sha}")


if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
