"""Core AI smoke test: a tiny Mamba-2 (two groups) exported with both functions (decode ``main``
and a 16-token ``prefill``) on one converter, lowered to the Linux universal form, run in the
Core AI runtime and compared with the reference (fp32)."""

from __future__ import annotations

import pytest

from coreai_smoke import export_lower_run
from mamba2_common import FAMILY, weights

pytest.importorskip("coreai_torch")
CHUNK = 16
TOL = 1e-3


def test_export_lower_run_matches_reference(tmp_path):
    g = FAMILY.geometry_from_shape({"layers": 2, "hidden": 64, "d_state": 16, "headdim": 16, "vocab": 256,
                                    "n_groups": 2}, "smoke")
    m = export_lower_run(FAMILY, g, weights(g, seed=11), CHUNK, tmp_path)
    assert m["d_all"] < TOL and m["d_state"] < TOL and m["top1"] == 1.0
