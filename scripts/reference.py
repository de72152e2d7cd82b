#!/usr/bin/env python3
"""Pipeline stage 'reference' (logic: rwkv7_coreai.reference_stream.main)."""
import sys

from rwkv7_coreai.reference_stream import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
