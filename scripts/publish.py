#!/usr/bin/env python3
"""Pipeline stage 'publish' (logic: rwkv7_coreai.cli.publish)."""
import sys

from rwkv7_coreai.cli import publish

sys.exit(publish())
