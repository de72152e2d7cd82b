#!/usr/bin/env python3
"""Pipeline stage 'aot' (logic: rwkv7_coreai.aot.main)."""
import sys

from rwkv7_coreai.aot import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
