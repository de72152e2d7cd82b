#!/usr/bin/env python3
"""Pipeline stage 'doctor' (logic: recurrent_coreai.stages.doctor.main)."""
import sys

from recurrent_coreai.stages.doctor import main

if __name__ == "__main__":  # a spawned worker process (the gate's) imports this file too
    sys.exit(main())
