#!/usr/bin/env python3
"""Pipeline stage 'gate' (logic: rwkv7_coreai.cli.gate)."""
import sys

from rwkv7_coreai.cli import gate

sys.exit(gate())
