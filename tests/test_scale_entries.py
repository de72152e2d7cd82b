"""The disabled scale entries of config.yaml carry the published geometries they name: each parses
with its family's shape rules and has exactly the published model's parameter count (a wrong width
or LoRA size would change it), and the 7B-class ones are written in a layout the source stage
streams (a 7B fp32 source is ~30 GB: it must never be held whole on a 24 GB node)."""

from __future__ import annotations

import pytest

from recurrent_coreai import families

# parameter counts of the published checkpoints these entries reproduce (their model pages; for
# Finch 7B, transformers' RWKV/v6-Finch-7B-HF)
PUBLISHED = {
    "rwkv6-7b-shape": 7_635_746_816,      # RWKV-6 Finch 7B
    "mamba2-7b-shape": 7_285_403_648,     # mistralai/Mamba-Codestral-7B-v0.1
}


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_a_scale_entry_has_the_published_parameter_count(cfg, model):
    spec = cfg["models"][model]
    assert spec["enabled"] is False  # never part of the default DAG
    family = families.get(spec["family"])
    geom = family.geometry_from_shape(spec["source"]["shape"], f"config.yaml models.{model}")
    assert family.parameter_count(geom) == PUBLISHED[model]


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_a_7b_entry_is_written_in_a_layout_the_source_stage_streams(cfg, model):
    spec = cfg["models"][model]
    # transformers' safetensors layout: written and normalised one tensor at a time
    # (tests/families/test_source_streaming.py); a pickle (.pth/.bin) is written whole by torch.save
    assert spec["source"]["layout"] == "hf"
    assert spec["source"]["layout"] in families.get(spec["family"]).synthetic_layouts
