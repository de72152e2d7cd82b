"""``tie_word_embeddings: true`` with a different ``lm_head`` stored (issue 34, case 4;
docs/bad-inputs.md row N18): refused in one line naming the user's file by the source stage's
streamed read -- in one file (copied as it is) and across two shards -- as the whole-file read
refuses it; a head equal to the embedding is accepted. Gated DeltaNet and Mamba-2 (the families
whose config ties the head)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recurrent_coreai import families
from recurrent_coreai.checkpoints.reader import write_normalized
from recurrent_coreai.stages.source import build_source
from recurrent_coreai.util.errors import PipelineError

HEAD = "lm_head.weight"
EMBED = {"gdn": "model.embeddings.weight", "mamba2": "backbone.embeddings.weight"}


def _tied_checkpoint(tmp_path: Path, cfg, family: str, same: bool, shards: int) -> Path:
    """A checkpoint in the normal form whose config.json ties the head, the head stored beside
    the embedding (``same``: equal to it), in ``shards`` files."""
    fam = families.get(family)
    model = {"family": family, "license": "mit", "tokenizer": "bytes",
             "source": {"kind": "synthetic", "seed": 4, "shape": {**fam.tiny_shape, "vocab": 256}}}
    built = tmp_path / "built"
    build_source("m", model, cfg["vocab"], built)
    weights = load_file(built / "model.safetensors")
    assert not torch.equal(weights[HEAD], weights[EMBED[family]])
    if same:
        weights[HEAD] = weights[EMBED[family]].clone()
    conf = json.loads((built / "config.json").read_text())
    conf["tie_word_embeddings"] = True
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(conf))
    names = list(weights)
    if shards == 1:
        save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
        return ckpt
    half = len(names) // 2
    files = {f"model-0000{i + 1}-of-00002.safetensors": part for i, part in enumerate((names[:half], names[half:]))}
    for fname, part in files.items():
        save_file({n: weights[n] for n in part}, ckpt / fname, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in files.items() for n in part}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    return ckpt


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
@pytest.mark.parametrize("shards", [1, 2])
def test_a_tied_head_that_differs_is_refused_by_the_streamed_read(tmp_path, cfg, family, shards):
    ckpt = _tied_checkpoint(tmp_path, cfg, family, same=False, shards=shards)
    dst = tmp_path / "out" / "model.safetensors"
    dst.parent.mkdir()
    with pytest.raises(PipelineError) as exc:
        write_normalized(ckpt, dst, families.get(family))
    line = str(exc.value)
    assert f": tensor {HEAD} differs from the tied embedding {EMBED[family]} (config.json ties them) -- fix: set " in line
    assert line.endswith("tie_word_embeddings false in config.json if the head is its own tensor") and "\n" not in line
    assert str(ckpt) in exc.value.where


@pytest.mark.parametrize("shards", [1, 2])
def test_a_tied_head_equal_to_the_embedding_is_accepted(tmp_path, cfg, shards):
    ckpt = _tied_checkpoint(tmp_path, cfg, "gdn", same=True, shards=shards)
    dst = tmp_path / "model.safetensors"
    write_normalized(ckpt, dst, families.get("gdn"))
    out = load_file(dst)
    assert torch.equal(out[HEAD], out[EMBED["gdn"]])
