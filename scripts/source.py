#!/usr/bin/env python3
"""Pipeline stage 'source' (logic: recurrent_coreai.stages.source.main), run in the Snakemake run's warm
process where it has one (recurrent_coreai.pipeline.warm), else in this one."""
import sys

from recurrent_coreai.pipeline.warm import run_stage

if __name__ == "__main__":
    sys.exit(run_stage("recurrent_coreai.stages.source", sys.argv[1:]))
