#!/usr/bin/env python3
"""After a Snakemake run (its onsuccess/onerror hook): record in DVC what THIS run built.

Logic: recurrent_coreai.pipeline.dvc_record. Prints one line; exits 0 when recording is not possible here
(no git, no DVC, another config than config.yaml) and nonzero only when DVC itself fails.
"""
import sys

from recurrent_coreai.pipeline.dvc_record import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
