#!/usr/bin/env python3
"""Pipeline stage 'vocab' (logic: rwkv7_coreai.vocab.main)."""
import sys

from rwkv7_coreai.vocab import main

sys.exit(main())
