#!/usr/bin/env python3
"""Pipeline stage 'gate' (logic: rwkv7_coreai.gate.main)."""
import sys

from rwkv7_coreai.gate import main

sys.exit(main())
