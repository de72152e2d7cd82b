#!/usr/bin/env python3
"""Pipeline stage 'aot' (logic: rwkv7_coreai.cli.aot)."""
import sys

from rwkv7_coreai.cli import aot

sys.exit(aot())
