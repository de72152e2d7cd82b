#!/usr/bin/env python3
"""Pipeline stage 'card' (logic: recurrent_coreai.stages.card.main)."""
import sys

from recurrent_coreai.stages.card import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
