"""RWKV-6's and Mamba-2's source stage streams (issue 27): the synthetic writer and the normalisation
of a checkpoint hold one tensor at a time, and write the bytes the whole-state-dict path writes.

* ``write_synthetic`` in the ``hf`` layout (both families) draws and writes one tensor at a time: a
  tracked iterator of the synthetic tensors never has more than a few of them alive (the whole-dict
  writer it replaces held all of them), and the file is what ``write_layout`` writes.
* A Mamba-2 checkpoint in either layout, tied or not, with a tied head left out or stored beside the
  embedding, is normalised while streamed (``Family.normal_stream``): the reader returns the normal
  form on the meta device (its streamed path; the whole path returns values) and the bytes of the
  whole path; a tied head that differs from the embedding is still one line naming the file.
* Mamba-2's head is drawn RANDN_CHUNK values at a time with the values of the whole-table formula.

The byte-identity of the source stage's outputs for the default models is checked by the stage tests
(tests/test_reproducible.py) and was checked by hand against the previous code
(docs/measurements/2026-12-02-source-streaming.md).
"""

from __future__ import annotations

import hashlib
import math
import types
import weakref
from pathlib import Path

import pytest
import torch

from recurrent_coreai.checkpoints import reader
from recurrent_coreai.families import get
from recurrent_coreai.families.draws import RANDN_CHUNK, Draws
from recurrent_coreai.util.errors import PipelineError

RWKV6, MAMBA2 = get("rwkv6"), get("mamba2")


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tracked(tensors, seen: dict):
    """The (name, tensor) pairs of ``tensors``, counting how many of those handed out are alive at
    each hand-out (held by nobody but the consumer and the producer)."""
    refs = []
    for name, t in tensors:
        refs.append(weakref.ref(t))
        seen["count"] += 1
        seen["alive"] = max(seen["alive"], sum(r() is not None for r in refs))
        yield name, t
        del t


@pytest.mark.parametrize("family,shape", [
    (RWKV6, RWKV6.tiny_shape),
    (MAMBA2, {**MAMBA2.tiny_shape, "tie_embeddings": False}),
    (MAMBA2, {**MAMBA2.tiny_shape, "tie_embeddings": True}),
], ids=["rwkv6", "mamba2-untied", "mamba2-tied"])
def test_synthetic_hf_is_written_one_tensor_at_a_time(family, shape, tmp_path, monkeypatch):
    geom = family.geometry_from_shape(shape, "test")
    want = family.write_layout(dict(family.synthetic_tensors(geom, 5)), tmp_path / "whole", "hf", geom)
    seen = {"count": 0, "alive": 0}
    drawn = family.synthetic_tensors
    monkeypatch.setattr(family, "synthetic_tensors", lambda g, s: tracked(drawn(g, s), seen))
    got = family.write_synthetic(geom, 5, tmp_path / "streamed", "hf")
    assert seen["count"] >= 20, seen
    # the one being written, the one just drawn, and a tied embedding the draws keep for the head
    assert seen["alive"] <= 3, f"{seen['alive']} of {seen['count']} synthetic tensors were held at once"
    assert sha(got) == sha(want)
    assert sha(got.parent / "config.json") == sha(want.parent / "config.json")


# case -> (layout, tied, the head stored beside a tied embedding in a safetensors file)
CASES = {"hf-tied": ("hf", True, False), "hf-untied": ("hf", False, False), "hf-tied-head-stored": ("hf", True, True),
         "mamba-ssm-tied": ("mamba-ssm", True, False), "mamba-ssm-untied": ("mamba-ssm", False, False)}


def _mamba2_checkpoint(root: Path, case: str) -> tuple[Path, object]:
    """A tiny Mamba-2 checkpoint directory and its geometry (write_layout: a tied hf head left out,
    a tied mamba-ssm head stored beside the embedding, one storage)."""
    import json

    from safetensors.torch import save_file

    layout, tied, head_stored = CASES[case]
    geom = MAMBA2.geometry_from_shape({**MAMBA2.tiny_shape, "tie_embeddings": tied}, "test")
    sd = dict(MAMBA2.synthetic_tensors(geom, 9))
    d = root / case
    if head_stored:
        d.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(MAMBA2.config_json(geom)))
    else:
        MAMBA2.write_layout(sd, d, layout, geom)
    return d, geom


@pytest.mark.parametrize("case", CASES)
def test_mamba2_checkpoints_are_normalised_while_streamed(case, tmp_path):
    src, geom = _mamba2_checkpoint(tmp_path, case)
    ck = reader.write_normalized(src, tmp_path / "streamed.safetensors", MAMBA2)
    assert all(t.is_meta for t in ck.tensors.values()), "the streamed path returns the normal form on meta"
    assert list(ck.tensors) == list(MAMBA2.normal_shapes(geom))
    whole = reader.read_checkpoint(src, MAMBA2)  # the whole path: every tensor in memory, normalize
    reader.save_normalized(whole.tensors, tmp_path / "whole.safetensors")
    assert sha(tmp_path / "streamed.safetensors") == sha(tmp_path / "whole.safetensors")


@pytest.mark.parametrize("case", ["hf-tied-head-stored", "mamba-ssm-tied"])
def test_mamba2_tied_head_that_differs_is_one_line_while_streamed(case, tmp_path):
    src, geom = _mamba2_checkpoint(tmp_path, case)
    weights = next(src.glob("*.safetensors"), None) or src / "pytorch_model.bin"
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file, save_file

        sd = load_file(str(weights))
        sd["lm_head.weight"] = sd["lm_head.weight"] + 1
        save_file(sd, str(weights), metadata={"format": "pt"})
    else:
        sd = torch.load(weights, weights_only=True)
        sd["lm_head.weight"] = sd["lm_head.weight"] + 1
        torch.save(sd, weights)
    embed = "backbone.embeddings.weight" if case.startswith("hf") else "backbone.embedding.weight"
    with pytest.raises(PipelineError) as err:
        reader.write_normalized(src, tmp_path / "out.safetensors", MAMBA2)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"{weights}: tensor lm_head.weight differs from the tied embedding {embed} "
                           "(config.json ties them)"), line
    assert "set tie_embeddings/tie_word_embeddings false" in line
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("layout", ["hf", "blinkdl"])
def test_rwkv6_checkpoints_are_normalised_while_streamed(layout, tmp_path):
    geom = RWKV6.geometry_from_shape(RWKV6.tiny_shape, "test")
    src = RWKV6.write_layout(dict(RWKV6.synthetic_tensors(geom, 4)), tmp_path / layout, layout, geom).parent
    ck = reader.write_normalized(src, tmp_path / "streamed.safetensors", RWKV6)
    assert all(t.is_meta for t in ck.tensors.values())
    reader.save_normalized(reader.read_checkpoint(src, RWKV6).tensors, tmp_path / "whole.safetensors")
    assert sha(tmp_path / "streamed.safetensors") == sha(tmp_path / "whole.safetensors")


@pytest.mark.parametrize("rows", [7, 1100])  # one draw call; three (1100 x 2048 > 2 RANDN_CHUNK, not a multiple)
def test_mamba2_head_drawn_in_chunks_has_the_whole_formula_values(rows):
    from recurrent_coreai.families.mamba2 import synthetic

    g = types.SimpleNamespace(hidden=2048)
    assert rows * g.hidden < 2 * RANDN_CHUNK or rows * g.hidden % RANDN_CHUNK
    d = Draws(31)
    want_rows = torch.exp(d.normal((rows, 1), synthetic.LM_HEAD_ROW_SPREAD, exact=True))
    want = (d.normal((rows, g.hidden), synthetic.LM_HEAD_GAIN / math.sqrt(g.hidden), exact=True) * want_rows).float()
    after = torch.randn(3, generator=d.gen)
    d2 = Draws(31)
    got = synthetic._head((rows, g.hidden), g, d2)
    assert torch.equal(got, want)
    assert torch.equal(torch.randn(3, generator=d2.gen), after), "the generator must end where the whole draw ends"
