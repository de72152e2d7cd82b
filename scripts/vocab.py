#!/usr/bin/env python3
"""Pipeline stage 'vocab' (logic: rwkv7_coreai.vocab.main)."""
import sys

from rwkv7_coreai.vocab import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
