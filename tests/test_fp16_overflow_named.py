"""A finite weight beyond float16's range, exported with a float16 recipe (issue 34, case 8;
docs/bad-inputs.md row N17): the export stage names the tensors in one line (it failed only at the
gate, with NaN states and no tensor named); a float32 recipe of the same source exports."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from recurrent_coreai import families
from recurrent_coreai.stages import export
from recurrent_coreai.stages.source import build_source
from recurrent_coreai.util.errors import PipelineError


def _source(tmp_path, cfg, family: str, value: float):
    fam = families.get(family)
    model = {"family": family, "license": "mit", "tokenizer": "bytes",
             "source": {"kind": "synthetic", "seed": 9, "shape": {**fam.tiny_shape, "vocab": 256}}}
    src = tmp_path / "source"
    build_source("m", model, cfg["vocab"], src)
    weights = load_file(src / "model.safetensors")
    name = next(n for n, t in weights.items() if t.ndim == 2 and "head" in n or "lm_head" in n)
    weights[name] = weights[name].clone()
    weights[name].view(-1)[:3] = value
    save_file(weights, src / "model.safetensors")
    return fam, src, name


@pytest.mark.parametrize("family", families.NAMES)
def test_a_weight_beyond_float16_is_named_by_the_export(tmp_path, cfg, family):
    fam, src, name = _source(tmp_path, cfg, family, 1e5)
    out = tmp_path / "export"
    with pytest.raises(PipelineError) as exc:
        export.export_recipe(fam, src, "fp16", {"dtype": "float16"}, "m-fp16", out, chunk=16)
    line = str(exc.value)
    assert line.startswith(f"{src / 'model.safetensors'}: 1 tensor(s) hold weights beyond float16's range (|x| > "
                           f"65504), which recipe fp16 (float16) would store as inf: {name} (3 of "), line
    assert "use a float32 recipe" in line and "\n" not in line and not out.exists()


def test_a_weight_within_float16_passes_the_check(tmp_path, cfg):
    """65504 itself fits: nothing is refused (the check reads the weights as they stream)."""
    fam, src, _ = _source(tmp_path, cfg, "rwkv7", 65504.0)
    geom, weights = export.stream_checkpoint(src, torch.float16, fam)
    assert sum(1 for _ in export.fitting(weights, torch.float16, "fp16", src / "model.safetensors")) > 0
    geom, weights = export.stream_checkpoint(src, torch.float32, fam)
    fam2, src2, _ = _source(tmp_path / "b", cfg, "rwkv7", 1e5)
    geom, weights = export.stream_checkpoint(src2, torch.float32, fam2)
    assert sum(1 for _ in export.fitting(weights, torch.float32, "fp32", src2 / "model.safetensors")) > 0
