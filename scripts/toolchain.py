#!/usr/bin/env python3
"""Pipeline stage 'toolchain' (logic: recurrent_coreai.stages.toolchain.main)."""
import sys

from recurrent_coreai.stages.toolchain import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
