"""The stages that compute nothing with torch start without importing it: every Snakemake job is a
fresh process, and importing torch costs seconds of each one (the card and report run once per
model, the DVC record re-derives them in its own process)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["recurrent_coreai.stages.card", "recurrent_coreai.stages.report",
                                    "recurrent_coreai.stages.vocab", "recurrent_coreai.stages.gate",
                                    "recurrent_coreai.stages.aot", "recurrent_coreai.stages.doctor"])
def test_the_stage_module_imports_no_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'coreai_torch') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]", f"{module} imports {proc.stdout.strip()} at start"
