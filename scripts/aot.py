#!/usr/bin/env python3
"""Pipeline stage 'aot' (logic: recurrent_coreai.stages.aot.main)."""
import sys

from recurrent_coreai.stages.aot import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
