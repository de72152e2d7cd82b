#!/usr/bin/env python3
"""Pipeline stage 'report' (logic: rwkv7_coreai.report.main)."""
import sys

from rwkv7_coreai.report import main

sys.exit(main())
