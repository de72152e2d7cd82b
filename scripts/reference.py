#!/usr/bin/env python3
"""Pipeline stage 'reference' (logic: rwkv7_coreai.reference_stream.main)."""
import sys

from rwkv7_coreai.reference_stream import main

sys.exit(main())
