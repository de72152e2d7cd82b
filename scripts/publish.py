#!/usr/bin/env python3
"""Pipeline stage 'publish' (logic: rwkv7_coreai.publish.main)."""
import sys

from rwkv7_coreai.publish import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
