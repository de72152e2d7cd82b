#!/usr/bin/env python3
"""Pipeline stage 'source' (logic: recurrent_coreai.stages.source.main)."""
import sys

from recurrent_coreai.stages.source import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
