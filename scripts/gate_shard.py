#!/usr/bin/env python3
"""Pipeline stage 'gate_shard' (logic: recurrent_coreai.stages.gate_shard.main)."""
import sys

from recurrent_coreai.stages.gate_shard import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
