#!/usr/bin/env python3
"""Pipeline stage 'report' (logic: recurrent_coreai.stages.report.main)."""
import sys

from recurrent_coreai.stages.report import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
