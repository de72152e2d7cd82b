#!/usr/bin/env python3
"""Pipeline stage 'report' (logic: rwkv7_coreai.report.main)."""
import sys

from rwkv7_coreai.report import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
