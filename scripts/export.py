#!/usr/bin/env python3
"""Pipeline stage 'export' (logic: rwkv7_coreai.export.main)."""
import sys

from rwkv7_coreai.export import main

sys.exit(main())
