#!/usr/bin/env python3
"""dvc.yaml's stage 'code': the code group files (logic: recurrent_coreai.pipeline.code_groups.main)."""
import sys

from recurrent_coreai.pipeline.code_groups import main

if __name__ == "__main__":
    sys.exit(main())
