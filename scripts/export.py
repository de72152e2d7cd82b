#!/usr/bin/env python3
"""Pipeline stage 'export' (logic: rwkv7_coreai.cli.export)."""
import sys

from rwkv7_coreai.cli import export

sys.exit(export())
