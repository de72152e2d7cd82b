#!/usr/bin/env python3
"""After a Snakemake run: refresh dvc.yaml from the DAG and record the outputs in DVC
(`dvc commit -f` of every stage whose outputs exist), so `dvc status` is clean."""
import subprocess
import sys
from pathlib import Path

import yaml

from rwkv7_coreai.dag import render, snakemake_jobs

text = render(snakemake_jobs("."))
if Path("dvc.yaml").read_text() != text:
    Path("dvc.yaml").write_text(text)
    print("dvc.yaml regenerated from the Snakefile's DAG (commit it)")
stages = yaml.safe_load(text)["stages"]
ready = [name for name, st in stages.items()
         if all(Path(next(iter(o)) if isinstance(o, dict) else o).exists()
                for key in ("outs", "metrics", "plots") for o in st.get(key, []))]
if ready:
    proc = subprocess.run(["dvc", "commit", "-f", "-q", *ready])
    if proc.returncode:
        print("error: dvc commit failed -- fix: run `dvc status` and `dvc commit -f` by hand", file=sys.stderr)
        sys.exit(proc.returncode)
print(f"recorded {len(ready)} of {len(stages)} DVC stages")
