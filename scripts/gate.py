#!/usr/bin/env python3
"""Pipeline stage 'gate' (logic: rwkv7_coreai.gate.main)."""
import sys

from rwkv7_coreai.gate import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
