#!/usr/bin/env python3
"""Pipeline stage 'doctor' (logic: rwkv7_coreai.doctor.main)."""
import sys

from rwkv7_coreai.doctor import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
