#!/usr/bin/env python3
"""Pipeline stage 'card' (logic: rwkv7_coreai.cli.card)."""
import sys

from rwkv7_coreai.cli import card

sys.exit(card())
