#!/usr/bin/env python3
"""Pipeline stage 'publish' (logic: rwkv7_coreai.publish.main)."""
import sys

from rwkv7_coreai.publish import main

sys.exit(main())
