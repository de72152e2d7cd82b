#!/usr/bin/env python3
"""Pipeline stage 'reference' (logic: recurrent_coreai.stages.reference.main)."""
import sys

from recurrent_coreai.stages.reference import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
