#!/usr/bin/env python3
"""Pipeline stage 'source' (logic: rwkv7_coreai.source.main)."""
import sys

from rwkv7_coreai.source import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
