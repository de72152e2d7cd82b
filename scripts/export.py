#!/usr/bin/env python3
"""Pipeline stage 'export' (logic: recurrent_coreai.stages.export.main)."""
import sys

from recurrent_coreai.stages.export import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
