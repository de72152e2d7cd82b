#!/usr/bin/env python3
"""Pipeline stage 'export' (logic: rwkv7_coreai.export.main)."""
import sys

from rwkv7_coreai.export import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
