#!/usr/bin/env python3
"""Pipeline stage 'source' (logic: rwkv7_coreai.source.main)."""
import sys

from rwkv7_coreai.source import main

sys.exit(main())
