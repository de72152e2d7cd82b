#!/usr/bin/env python3
"""Pipeline stage 'vocab' (logic: rwkv7_coreai.cli.vocab)."""
import sys

from rwkv7_coreai.cli import vocab

sys.exit(vocab())
