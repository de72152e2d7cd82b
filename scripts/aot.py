#!/usr/bin/env python3
"""Pipeline stage 'aot' (logic: rwkv7_coreai.aot.main)."""
import sys

from rwkv7_coreai.aot import main

sys.exit(main())
