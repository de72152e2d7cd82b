#!/usr/bin/env python3
"""Pipeline stage 'card' (logic: rwkv7_coreai.card.main)."""
import sys

from rwkv7_coreai.card import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
