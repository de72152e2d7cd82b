#!/usr/bin/env python3
"""Pipeline stage 'source' (logic: rwkv7_coreai.cli.source)."""
import sys

from rwkv7_coreai.cli import source

sys.exit(source())
