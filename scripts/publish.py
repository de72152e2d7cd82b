#!/usr/bin/env python3
"""Pipeline stage 'publish' (logic: recurrent_coreai.stages.publish.main)."""
import sys

from recurrent_coreai.stages.publish import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
