#!/usr/bin/env python3
"""Write dvc.yaml from the Snakemake DAG (`--check`: exit 1 if the committed one is stale)."""
import sys
from pathlib import Path

from recurrent_coreai.pipeline import config
from recurrent_coreai.pipeline.dag import render, snakemake_jobs

text = render(snakemake_jobs("."), config.read_yaml(config.DEFAULT_FILE))
if "--check" in sys.argv:
    if Path("dvc.yaml").read_text() != text:
        print("error: dvc.yaml: stale, it does not match the Snakefile's DAG -- fix: python scripts/gen_dvc.py",
              file=sys.stderr)
        sys.exit(1)
    sys.exit(0)
Path("dvc.yaml").write_text(text)
print("wrote dvc.yaml")
