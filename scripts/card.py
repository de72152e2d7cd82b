#!/usr/bin/env python3
"""Pipeline stage 'card' (logic: rwkv7_coreai.card.main)."""
import sys

from rwkv7_coreai.card import main

sys.exit(main())
