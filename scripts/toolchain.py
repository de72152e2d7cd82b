#!/usr/bin/env python3
"""Pipeline stage 'toolchain' (logic: rwkv7_coreai.cli.toolchain)."""
import sys

from rwkv7_coreai.cli import toolchain

sys.exit(toolchain())
