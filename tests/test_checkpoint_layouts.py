"""The three accepted checkpoint layouts load to the same normalised tensors, and broken
checkpoints fail with a PipelineError that says which tensor / file and what was expected.

Layouts: fla split mixers (``attn.x_r`` … in model.safetensors + config.json), older fla with
packed ``attn.x_x`` [6,C], and a BlinkDL x070 ``.pth`` without config.json. Each goes through
``checkpoint.load_checkpoint`` and through the ``path`` kind of ``source.build_source``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from recurrent_coreai.families.rwkv7 import blinkdl
from recurrent_coreai.checkpoints import reader as checkpoint
from recurrent_coreai.families.rwkv7 import layouts as rwkv7_layouts
from recurrent_coreai.pipeline.config import load as load_config
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.families.rwkv7.geometry import Geometry, expected_shapes
from recurrent_coreai.pipeline.records import SEAL, read_manifest
from recurrent_coreai.stages.source import build_source
from recurrent_coreai.families.rwkv7.synthetic import pack_mixers, synthetic_state_dict, write_weights

REPO = Path(__file__).resolve().parents[1]
G = Geometry(layers=2, hidden=128, head_dim=64, ffn=256, vocab=512,
             decay_lora=16, a_lora=8, v_lora=24, gate_lora=32)
# What the source stage builds must also fit the RWKV World vocabulary (ids 0..65529; real
# checkpoints have 65536 rows): it refuses an embedding or head with fewer rows (tokenizers/fit.py).
# The reader-only tests keep G's small vocab; hidden 64 keeps GW's [65536, 64] embedding and head at
# 16 MB each.
GW = dataclasses.replace(G, hidden=64, head_dim=32, vocab=65536)
SEED = 99
LAYOUTS = ("fla-split", "fla-packed", "blinkdl")


@pytest.fixture(scope="module")
def sd():
    return synthetic_state_dict(G, SEED)


@pytest.fixture(scope="module")
def sd_world():
    return synthetic_state_dict(GW, SEED)


@pytest.fixture(scope="module")
def vocab_cfg():
    return load_config(REPO / "config.yaml")["vocab"]


def write_layout(sd: dict, layout: str, root: Path, g: Geometry = G) -> Path:
    """A checkpoint on disk (of geometry ``g``); returns what a user would point the source at."""
    root.mkdir(parents=True, exist_ok=True)
    path = write_weights(sd, root, layout)
    if layout == "blinkdl":
        assert not (root / "config.json").exists()
        return path                      # the .pth file itself
    (root / "config.json").write_text(json.dumps(g.to_hf_config()))
    return root                          # an HF-layout directory


def write_raw(tensors: dict, layout: str, root: Path) -> Path:
    """Like write_layout, but tensors are written exactly as given (already in the layout's names)."""
    root.mkdir(parents=True, exist_ok=True)
    if layout == "blinkdl":
        path = root / "model.pth"
        torch.save(tensors, path)
        return path
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(G.to_hf_config()))
    return root


def in_layout(sd: dict, layout: str) -> dict:
    return {"fla-split": dict, "fla-packed": pack_mixers, "blinkdl": blinkdl.from_hf}[layout](sd)


def assert_same_tensors(got: dict, want: dict, g: Geometry = G) -> None:
    assert list(got) == list(expected_shapes(g)), "normal form must list tensors in expected_shapes order"
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        assert tuple(got[k].shape) == tuple(v.shape), k
        assert torch.equal(got[k], v), k


# --- the same tensors from every layout ---------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_is_detected(sd, layout):
    assert rwkv7_layouts.detect_layout(in_layout(sd, layout).keys()) == layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_checkpoint_normalises(sd, layout, tmp_path):
    src = write_layout(sd, layout, tmp_path / layout)
    geom, got = checkpoint.load_checkpoint(src)
    assert geom == G
    assert_same_tensors(got, sd)


def test_blinkdl_directory_without_config(sd, tmp_path):
    """A directory holding only the .pth is read as well (geometry from the tensors)."""
    write_layout(sd, "blinkdl", tmp_path / "bd")
    geom, got = checkpoint.load_checkpoint(tmp_path / "bd")
    assert geom == G
    assert_same_tensors(got, sd)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_build_source_path(sd_world, vocab_cfg, layout, tmp_path):
    sd = sd_world
    src = write_layout(sd, layout, tmp_path / "in" / layout, GW)
    model_cfg = {"family": "rwkv7", "source": {"kind": "path", "path": str(src)}, "license": "apache-2.0"}
    out = tmp_path / "out"
    manifest = build_source("layout-test", model_cfg, vocab_cfg, out)
    assert manifest["layout"] == layout
    assert manifest["normalized_to"] == "fla-split"
    assert manifest["geometry"] == GW.as_dict()
    assert manifest["source"]["kind"] == "path"
    written = read_manifest(out)  # checked: its seal and every file's digest
    assert written.pop(SEAL)["stage"] == "source" and written == manifest
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert not list(out.glob("*.pth"))
    assert json.loads((out / "config.json").read_text())["hidden_size"] == GW.hidden
    geom, got = checkpoint.load_checkpoint(out)
    assert geom == GW
    assert rwkv7_layouts.detect_layout(checkpoint.read_tensors([out / "model.safetensors"]).keys()) == "fla-split"
    assert_same_tensors(got, sd, GW)
    # the manifest describes the files really written
    for name, entry in manifest["files"].items():
        assert (out / name).stat().st_size == entry["size"], name


def test_all_layouts_give_identical_source_bytes(sd_world, vocab_cfg, tmp_path):
    """The normalised model.safetensors is byte-identical whatever the input layout."""
    blobs = {}
    for layout in LAYOUTS:
        src = write_layout(sd_world, layout, tmp_path / "in" / layout, GW)
        out = tmp_path / "out" / layout
        build_source("layout-test", {"family": "rwkv7", "source": {"kind": "path", "path": str(src)}, "license": "mit"}, vocab_cfg, out)
        blobs[layout] = (out / "model.safetensors").read_bytes()
    assert blobs["fla-packed"] == blobs["fla-split"]
    assert blobs["blinkdl"] == blobs["fla-split"]


# --- broken checkpoints -----------------------------------------------------------------------
# (normalised name, name in the BlinkDL file, expected shape)
MISSING = [
    ("model.layers.1.attn.k_k", "blocks.1.att.k_k", (G.hidden,)),
    ("model.layers.1.ffn.value.weight", "blocks.1.ffn.value.weight", (G.hidden, G.ffn)),
    ("model.layers.1.attn.v_lora.lora.2.bias", "blocks.1.att.v0", (G.hidden,)),
    ("model.norm.weight", "ln_out.weight", (G.hidden,)),
]


def _message(excinfo) -> str:
    return str(excinfo.value)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("missing", MISSING, ids=lambda m: m[0])
def test_missing_tensor(sd, layout, missing, tmp_path):
    hf_name, bd_name, shape = missing
    tensors = in_layout(sd, layout)
    del tensors[bd_name if layout == "blinkdl" else hf_name]
    src = write_raw(tensors, layout, tmp_path)
    with pytest.raises(PipelineError) as excinfo:
        checkpoint.load_checkpoint(src)
    msg = _message(excinfo)
    assert hf_name in msg or bd_name in msg, msg
    assert "missing" in msg, msg
    assert str(list(shape)) in msg, msg


def test_missing_mixer_in_packed_layout(sd, tmp_path):
    """Split x_r..x_g missing entirely (no x_x either) -> named with its shape."""
    tensors = pack_mixers(sd)
    del tensors["model.layers.0.attn.x_x"]
    with pytest.raises(PipelineError) as excinfo:
        checkpoint.load_checkpoint(write_raw(tensors, "fla-packed", tmp_path))
    msg = _message(excinfo)
    assert "model.layers.0.attn.x_" in msg and str([1, 1, G.hidden]) in msg, msg


EXTRA = {"fla-split": "model.layers.0.attn.bogus", "fla-packed": "model.layers.1.ffn.extra_bias",
         "blinkdl": "blocks.0.att.time_bogus"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_extra_tensor(sd, layout, tmp_path):
    tensors = in_layout(sd, layout)
    tensors[EXTRA[layout]] = torch.zeros(3)
    src = write_raw(tensors, layout, tmp_path)
    with pytest.raises(PipelineError) as excinfo:
        checkpoint.load_checkpoint(src)
    msg = _message(excinfo)
    assert EXTRA[layout] in msg and "unexpected" in msg, msg


def test_extra_global_tensor_blinkdl(sd, tmp_path):
    tensors = blinkdl.from_hf(sd)
    tensors["head.bias"] = torch.zeros(G.vocab)
    with pytest.raises(PipelineError) as excinfo:
        checkpoint.load_checkpoint(write_raw(tensors, "blinkdl", tmp_path))
    assert "head.bias" in _message(excinfo)


# (fla name, BlinkDL name, bad shape in the file's own layout, expected normalised shape)
MISSHAPED = [
    ("model.layers.0.attn.r_proj.weight", "blocks.0.att.receptance.weight", (G.hidden, G.hidden + 1),
     (G.hidden, G.hidden)),
    ("model.layers.1.attn.r_k", "blocks.1.att.r_k", (G.heads * 2, G.head_dim // 2), (G.heads, G.head_dim)),
    ("lm_head.weight", "head.weight", (G.vocab - 1, G.hidden), (G.vocab, G.hidden)),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bad", MISSHAPED, ids=lambda m: m[0])
def test_misshaped_tensor(sd, layout, bad, tmp_path):
    hf_name, bd_name, bad_shape, want = bad
    tensors = in_layout(sd, layout)
    tensors[bd_name if layout == "blinkdl" else hf_name] = torch.zeros(bad_shape)
    src = write_raw(tensors, layout, tmp_path)
    with pytest.raises(PipelineError) as excinfo:
        checkpoint.load_checkpoint(src)
    msg = _message(excinfo)
    assert hf_name in msg or bd_name in msg, msg
    assert str(list(want)) in msg, msg


def test_misshaped_lora_blinkdl(sd, tmp_path):
    """BlinkDL w1 is [C, D] (transposed against fla); a wrong D is named with the fla shape."""
    tensors = blinkdl.from_hf(sd)
    tensors["blocks.1.att.a1"] = torch.zeros(G.hidden, G.a_lora + 2)
    with pytest.raises(PipelineError) as excinfo:
        checkpoint.load_checkpoint(write_raw(tensors, "blinkdl", tmp_path))
    msg = _message(excinfo)
    assert "a_lora" in msg or "att.a1" in msg, msg
    assert str([G.a_lora, G.hidden]) in msg or str([G.hidden, G.a_lora]) in msg, msg


def test_config_disagrees_with_weights(sd, tmp_path):
    src = write_layout(sd, "fla-split", tmp_path)
    cfg = G.to_hf_config()
    cfg["intermediate_size"] = G.ffn * 2
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PipelineError) as excinfo:
        checkpoint.load_checkpoint(src)
    msg = _message(excinfo)
    assert "ffn.key.weight" in msg and str([G.ffn * 2, G.hidden]) in msg, msg


@pytest.mark.parametrize("keep", ["header", "half"])
def test_truncated_safetensors(sd, tmp_path, keep):
    src = write_layout(sd, "fla-split", tmp_path / "trunc")
    f = src / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:40] if keep == "header" else data[: len(data) // 2])
    with pytest.raises(PipelineError) as excinfo:
        checkpoint.load_checkpoint(src)
    assert str(f) in _message(excinfo), _message(excinfo)


def test_truncated_safetensors_via_build_source(sd, vocab_cfg, tmp_path):
    src = write_layout(sd, "fla-packed", tmp_path / "trunc")
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    out = tmp_path / "out"
    with pytest.raises(PipelineError) as excinfo:
        build_source("t", {"family": "rwkv7", "source": {"kind": "path", "path": str(src)}, "license": "mit"}, vocab_cfg, out)
    assert str(f) in _message(excinfo)
    assert not out.exists(), "a failed source stage must not leave an output directory"


def test_truncated_pth(sd, tmp_path):
    path = write_layout(sd, "blinkdl", tmp_path / "bd")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(PipelineError) as excinfo:
        checkpoint.load_checkpoint(path)
    assert str(path) in _message(excinfo)


def test_source_path_missing(vocab_cfg, tmp_path):
    with pytest.raises(PipelineError) as excinfo:
        build_source("t", {"family": "rwkv7", "source": {"kind": "path", "path": str(tmp_path / "nope")}, "license": "mit"},
                     vocab_cfg, tmp_path / "out")
    assert "nope" in _message(excinfo)


# BlinkDL x070 .pth files from RWKV-LM versions that create v0/v1/v2 in every layer carry
# blocks.0.att.v0/v1/v2, which x070 never uses (rwkv.model replaces them with empty tensors).
def test_blinkdl_unused_layer0_v_lora_is_accepted(sd, tmp_path):
    tensors = blinkdl.from_hf(sd)
    tensors["blocks.0.att.v0"] = torch.ones(1, 1, G.hidden)
    tensors["blocks.0.att.v1"] = torch.zeros(G.hidden, G.v_lora)
    tensors["blocks.0.att.v2"] = torch.zeros(G.v_lora, G.hidden)
    geom, got = checkpoint.load_checkpoint(write_raw(tensors, "blinkdl", tmp_path))
    assert geom == G
    assert_same_tensors(got, sd)


def test_blinkdl_errors_name_the_tensor_as_the_file_does(sd, tmp_path):
    tensors = blinkdl.from_hf(sd)
    del tensors["blocks.1.att.a1"]
    with pytest.raises(PipelineError) as exc:
        checkpoint.load_checkpoint(write_raw(tensors, "blinkdl", tmp_path))
    msg = str(exc.value)
    assert "(BlinkDL blocks.1.att.a1) is missing" in msg and "x070 .pth" in msg and "config.json" not in msg
