#!/usr/bin/env python3
"""Pipeline stage 'doctor' (logic: rwkv7_coreai.doctor.main)."""
import sys

from rwkv7_coreai.doctor import main

sys.exit(main())
