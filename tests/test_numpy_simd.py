"""numpy's kernels capped at X86_V3 (recurrent_coreai/util/numpy_simd.py): the gate's numbers --
and so its records, the card and dvc.lock -- are the same bytes on AVX2 and AVX-512 hosts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recurrent_coreai.util import numpy_simd

REPO = Path(__file__).resolve().parents[1]

# The gate's comparison of one fixed pair of logit vectors, on the recorded kernels: the values
# computed on an AVX2 host (X86_V3) and on an AVX-512 host with the cap (2026-12-03: both these).
COMPARE = """
import json, sys
if sys.argv[1] == "capped":
    import recurrent_coreai  # noqa: F401  (first, as every stage entry point)
import numpy as np
from recurrent_coreai.stages.gate import compare
rng = np.random.default_rng(20261203)
ref = rng.normal(0, 4, 65536)
row = compare(ref, ref + rng.normal(0, 1e-3, 65536), 0.1)
print(json.dumps({"kl": row["kl"].hex(), "max_abs_dlogits": row["max_abs_dlogits"].hex()}))
"""
RECORDED = {"kl": "0x1.2b5958f5fb400p-22", "max_abs_dlogits": "0x1.38e4382776c00p-8"}


def _python(code: str, *args: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != numpy_simd.NUMPY_SIMD_ENV}
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO,
                          env={**environ, "PYTHONPATH": str(REPO), **env}, check=True)
    return proc.stdout + proc.stderr


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


needs_x86_v3 = pytest.mark.skipif(not {"avx2", "fma"} <= _cpu_flags(),
                                  reason="this host has no AVX2+FMA (X86_V3): numpy runs its baseline kernels here")


@needs_x86_v3
def test_a_stage_process_runs_the_recorded_kernels():
    out = _python("import json, recurrent_coreai, numpy; from recurrent_coreai.util import numpy_simd; "
                  "print(json.dumps(numpy_simd.gate_kernels()))")
    kernels = json.loads(out.strip().splitlines()[-1])
    assert kernels and set(kernels.values()) == {numpy_simd.RECORDED_TARGET}, kernels


@needs_x86_v3
def test_this_test_process_runs_the_stages_kernels():
    """tests/conftest.py imports recurrent_coreai before numpy loads: a number a test computes in
    its own process is the one a stage (or a gate worker it spawns) computes."""
    assert numpy_simd.off_record() == {}


@needs_x86_v3
def test_the_gates_numbers_on_the_recorded_kernels_are_the_recorded_bytes():
    assert json.loads(_python(COMPARE, "capped").strip().splitlines()[-1]) == RECORDED


def test_without_the_cap_an_avx512_host_computes_other_bytes():
    """Why the cap exists: numpy loaded before recurrent_coreai runs its X86_V4 kernels on an
    AVX-512 host, and the gate's KL differs in its last bits."""
    if "avx512f" not in _cpu_flags():
        pytest.skip("not an AVX-512 host: numpy runs the recorded kernels without the cap too")
    assert json.loads(_python(COMPARE, "raw").strip().splitlines()[-1])["kl"] != RECORDED["kl"]


def test_other_kernels_than_the_records_are_said_in_one_warning():
    """A list of the user's own in the environment is kept (numpy reads only one), and the gate says
    its numbers will not be the record's: here one that takes X86_V3 away too (baseline kernels)."""
    code = ("import logging, recurrent_coreai; logging.basicConfig(level=logging.INFO); "
            "from recurrent_coreai.util import numpy_simd; numpy_simd.warn_unless_recorded_kernels()")
    out = _python(code, **{numpy_simd.NUMPY_SIMD_ENV: "X86_V3 " + numpy_simd.ABOVE_RECORDED})
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, out
    assert "differ in their last bits from dvc.lock's" in warnings[0] and "baseline" in warnings[0], warnings
    assert "fix:" in warnings[0]
    quiet = _python(code)
    assert "WARNING" not in quiet or not {"avx2", "fma"} <= _cpu_flags(), quiet


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "scripts").glob("*.py")))
def test_every_entry_point_caps_numpy_before_numpy_loads(script):
    """numpy reads its list once, when it loads: each scripts/ entry (what Snakemake and DVC run)
    must have the cap in the environment by then, on every host."""
    code = f"""
import importlib.abc, os, runpy, sys
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" and not seen:
            seen.append(os.environ.get({numpy_simd.NUMPY_SIMD_ENV!r}))
        return None
sys.meta_path.insert(0, Watch())
runpy.run_path("scripts/{script}", run_name="imported")
print("numpy loaded with", repr(seen[0]) if seen else "no numpy")
"""
    out = _python(code).strip().splitlines()[-1]
    assert out in (f"numpy loaded with {numpy_simd.ABOVE_RECORDED!r}", "numpy loaded with no numpy"), out
