#!/usr/bin/env python3
"""Pipeline stage 'toolchain' (logic: rwkv7_coreai.toolchain.main)."""
import sys

from rwkv7_coreai.toolchain import main

sys.exit(main())
