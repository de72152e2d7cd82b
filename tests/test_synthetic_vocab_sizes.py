"""A synthetic model whose ``shape.vocab`` its BPE tokenizer cannot be made for (issue 34, case 11;
docs/bad-inputs.md row N10): a gdn (sp-bpe) or mamba2 (hf-bpe) with ``vocab: 200`` is one line at
the config check (the kind's MIN_VOCAB), and a size the synthetic trainer cannot hit exactly (264
for sp-bpe) one line from the source stage naming the key -- both were "internal error" lines."""

from __future__ import annotations

import copy

import pytest

from recurrent_coreai import families
from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.stages.source import build_source
from recurrent_coreai.util.errors import PipelineError


def _model(family: str, vocab: int) -> dict:
    return {"enabled": True, "family": family, "dir": family, "license": "mit",
            "source": {"kind": "synthetic", "seed": 7, "shape": {**families.get(family).tiny_shape, "vocab": vocab}},
            "recipes": ["fp32"], "targets": ["universal"], "publish": {"repo": None, "push": False}}


@pytest.mark.parametrize("family, kind, least", [("gdn", "sp-bpe", 261), ("mamba2", "hf-bpe", 257)])
def test_a_vocab_below_the_synthetic_tokenizers_is_refused_by_the_config_check(cfg, tmp_path, family, kind, least):
    raw = {k: copy.deepcopy(v) for k, v in cfg.items() if k != cfgmod.ORIGIN_KEY}
    raw.update(models={"m": _model(family, 200)}, build=["m"], results=str(tmp_path / "results"))
    with pytest.raises(PipelineError) as exc:
        cfgmod.validate(raw, "config.yaml")
    assert str(exc.value) == (f"config.yaml: models/m/source/shape/vocab 200 is smaller than the {kind} tokenizer's "
                              f"{least} ids -- fix: use vocab >= {least}, or set models/m/tokenizer to the kind the "
                              "model was trained with")
    raw["models"]["m"] = _model(family, least)
    cfgmod.validate(raw, "config.yaml")  # the least it states is accepted


def test_a_size_the_synthetic_trainer_cannot_hit_is_one_line_from_the_source_stage(cfg, tmp_path):
    out = tmp_path / "source"
    with pytest.raises(PipelineError) as exc:
        build_source("m", _model("gdn", 264), cfg["vocab"], out)
    line = str(exc.value)
    assert line.startswith("config.yaml: source.shape.vocab 264: the synthetic tokenizer cannot have exactly that "
                           "many ids (the synthetic corpus yields 263 tokens, not 264") and "\n" not in line, line
    assert line.endswith("-- fix: use another vocab (1024, the synthetic tokenizer's full size, always works)")
    assert not out.exists()
