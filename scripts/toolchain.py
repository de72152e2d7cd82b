#!/usr/bin/env python3
"""Pipeline stage 'toolchain' (logic: rwkv7_coreai.toolchain.main)."""
import sys

from rwkv7_coreai.toolchain import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
