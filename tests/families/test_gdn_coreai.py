"""Core AI smoke test: a tiny Gated DeltaNet (GVA: 4 value heads over 2 q/k heads, expand_v 2,
negative eigenvalues allowed) exported with ``main`` and a 16-token ``prefill``, lowered, run in the
Core AI runtime and compared with the reference (fp32): coreai_smoke.py."""

from __future__ import annotations

import pytest

from coreai_smoke import export_lower_run
from recurrent_coreai import families

pytest.importorskip("coreai_torch")
FAMILY = families.get("gdn")
TOL = 1e-3


def test_export_lower_run_matches_reference(tmp_path):
    g = FAMILY.geometry_from_shape(FAMILY.tiny_shape, "smoke")
    m = export_lower_run(FAMILY, g, dict(FAMILY.synthetic_tensors(g, 11)), 16, tmp_path)
    assert m["d_all"] < TOL and m["d_state"] < TOL and m["top1"] == 1.0
