#!/usr/bin/env python3
"""After a Snakemake run (its onsuccess/onerror hook): record in DVC what THIS run built.

Logic: recurrent_coreai.pipeline.dvc_record. Prints one line; exits 0 when recording is not possible here
(no git, no DVC, another config than config.yaml) and nonzero when DVC fails or an output is refused:
its bytes differ from its stage's record, or a derived record disagrees with what it is derived from.
"""
import sys

from recurrent_coreai.pipeline.dvc_record import main
from recurrent_coreai.stages.derivation import check_stage

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main(derived=check_stage))  # derived records against their inputs (stages/derivation.py)
