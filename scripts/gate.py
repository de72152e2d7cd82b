#!/usr/bin/env python3
"""Pipeline stage 'gate' (logic: recurrent_coreai.stages.gate.main), run in the Snakemake run's warm
process where it has one (recurrent_coreai.pipeline.warm), else in this one."""
import sys

from recurrent_coreai.pipeline.warm import run_stage

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(run_stage("recurrent_coreai.stages.gate", sys.argv[1:]))
