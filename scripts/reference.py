#!/usr/bin/env python3
"""Pipeline stage 'reference' (logic: rwkv7_coreai.cli.reference)."""
import sys

from rwkv7_coreai.cli import reference

sys.exit(reference())
