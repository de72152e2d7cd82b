"""Core AI smoke test: tiny Mamba-1 models (a plain one with an explicit dt_rank and an untied head,
and a Falcon Mamba one) exported with both functions (decode ``main`` and a 16-token ``prefill``,
two blocks of the chunked scan) on one converter, lowered to the Linux universal form, run in the
Core AI runtime and compared with the reference (fp32)."""

from __future__ import annotations

import pytest

from coreai_smoke import export_lower_run
from mamba1_common import FAMILY, weights

pytest.importorskip("coreai_torch")
CHUNK = 16
TOL = 1e-3


@pytest.mark.parametrize("falcon", [False, True], ids=["mamba", "falcon_mamba"])
def test_export_lower_run_matches_reference(tmp_path, falcon):
    g = FAMILY.geometry_from_shape({"layers": 2, "hidden": 64, "d_state": 16, "vocab": 256, "dt_rank": 6,
                                    "falcon": falcon}, "smoke")
    m = export_lower_run(FAMILY, g, weights(g, seed=11), CHUNK, tmp_path)
    assert m["d_all"] < TOL and m["d_state"] < TOL and m["top1"] == 1.0
