#!/usr/bin/env python3
"""Pipeline stage 'vocab' (logic: recurrent_coreai.stages.vocab.main)."""
import sys

from recurrent_coreai.stages.vocab import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
