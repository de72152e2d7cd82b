"""RWKV-6 layouts, geometry and synthetic weights.

Both layouts (``hf`` = the normal form, RWKV/v6-Finch-*-HF names + config.json; ``blinkdl`` =
x060 .pth) normalise to byte-identical normal-form tensors, whole and tensor by tensor; a missing,
extra or mis-shaped tensor is one line naming it (with its BlinkDL name) and the expected shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from recurrent_coreai.families import detect, get
from recurrent_coreai.families.rwkv6 import layouts
from recurrent_coreai.families.rwkv6.geometry import Geometry
from recurrent_coreai.util.errors import PipelineError

FAM = get("rwkv6")
G = Geometry(layers=2, hidden=128, ffn=448, vocab=512, mix_lora=16, decay_lora=32)
SEED = 3


@pytest.fixture(scope="module")
def sd():
    return dict(FAM.synthetic_tensors(G, SEED))


def read_back(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".pth":
        return torch.load(path, map_location="cpu", weights_only=True)
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def assert_identical(got: dict, want: dict) -> None:
    assert list(got) == list(FAM.normal_shapes(G)), "normal form must follow normal_shapes order"
    for k, v in want.items():
        assert got[k].dtype == v.dtype and tuple(got[k].shape) == tuple(v.shape), k
        assert got[k].contiguous().view(torch.uint8).equal(v.contiguous().view(torch.uint8)), k


@pytest.mark.parametrize("layout", FAM.layouts)
def test_layout_roundtrip_byte_identical(sd, layout, tmp_path):
    path = FAM.write_layout(sd, tmp_path, layout)
    assert (tmp_path / "config.json").exists() == (layout == "hf")
    raw = read_back(path)
    assert FAM.detect_layout(raw) == layout
    assert ("rwkv6", layout) in detect(raw)
    if layout == "blinkdl":
        assert "blocks.0.ln0.weight" in raw and "blocks.1.att.time_maa_w1" in raw and "emb.weight" in raw
        assert "blocks.0.ffn.time_maa_r" in raw and "ln_out.bias" in raw and "head.weight" in raw
    shapes = {k: tuple(v.shape) for k, v in raw.items()}
    assert FAM.geometry_from_tensors(shapes, layout, path) == G
    if layout == "hf":
        assert FAM.geometry_from_config(json.loads((tmp_path / "config.json").read_text()), tmp_path) == G
    assert_identical(FAM.normalize(raw, G, path), sd)
    # streamed: tensor by tensor
    parts = dict(p for name, t in raw.items() for p in FAM.normal_parts(layout, name, t))
    assert_identical({k: parts[k] for k in FAM.normal_shapes(G)}, sd)
    assert set(parts) == set(sd)


def test_rwkv7_names_are_not_rwkv6():
    assert FAM.detect_layout(["emb.weight", "blocks.0.att.r_k", "blocks.0.att.w1"]) is None
    assert FAM.detect_layout(["model.embeddings.weight", "model.layers.0.attn.x_r"]) is None


def one_line(exc: PipelineError) -> str:
    msg = str(exc)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("layout", FAM.layouts)
def test_missing_extra_misshaped_name_the_tensor(sd, layout, tmp_path):
    raw = read_back(FAM.write_layout(sd, tmp_path, layout))
    blink = layout == "blinkdl"
    name = "blocks.1.att.time_decay_w2" if blink else "rwkv.blocks.1.attention.time_decay_w2"
    normal = "rwkv.blocks.1.attention.time_decay_w2"

    missing = {k: v for k, v in raw.items() if k != name}
    with pytest.raises(PipelineError) as e:
        FAM.normalize(missing, G, "ckpt")
    msg = one_line(e.value)
    assert f"tensor {normal}" in msg and "missing" in msg and "[32, 128]" in msg
    assert (f"BlinkDL {name}" in msg) == blink

    bad = dict(raw)
    bad[name] = torch.zeros(16, 128)
    with pytest.raises(PipelineError) as e:
        FAM.normalize(bad, G, "ckpt")
    msg = one_line(e.value)
    assert normal in msg and "[16, 128]" in msg and "expected [32, 128]" in msg

    extra = dict(raw)
    extra_name = "blocks.0.att.time_state" if blink else "rwkv.blocks.0.attention.time_state"
    extra[extra_name] = torch.zeros(2, 64, 64)
    with pytest.raises(PipelineError) as e:
        FAM.normalize(extra, G, "ckpt")
    assert f"unexpected tensor {extra_name}" in one_line(e.value)


def test_synthetic_is_deterministic_and_realistic(tmp_path):
    a = FAM.write_layout(dict(FAM.synthetic_tensors(G, SEED)), tmp_path / "a", "hf")
    b = FAM.write_layout(dict(FAM.synthetic_tensors(G, SEED)), tmp_path / "b", "hf")
    c = FAM.write_layout(dict(FAM.synthetic_tensors(G, SEED + 1)), tmp_path / "c", "hf")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    sd = dict(FAM.synthetic_tensors(G, SEED))
    assert list(sd) == list(FAM.normal_shapes(G))
    w = torch.exp(-torch.exp(sd["rwkv.blocks.0.attention.time_decay"]))
    assert 0.25 < float(w.min()) < 0.45 and 0.995 < float(w.max()) < 0.9999
    # peaked logits: top-1 stands out on most steps
    logits, _ = FAM.reference(sd, G).run(list(range(40)))
    top2 = torch.topk(logits, 2).values
    assert float((top2[:, 0] - top2[:, 1]).median()) > 0.3


def test_geometry_from_shape_and_dict():
    shape = {"layers": 2, "hidden": 128, "head_dim": 64, "ffn": 448, "vocab": 512, "mix_lora": 16, "decay_lora": 32}
    g = FAM.geometry_from_shape(shape, "config.yaml")
    assert g == G and FAM.geometry_from_dict(g.as_dict()) == g
    assert set(FAM.shape_keys) == set(shape)
    for bad, what in [({k: v for k, v in shape.items() if k != "vocab"}, "lacks 'vocab'"),
                      ({**shape, "a_lora": 4}, "key 'a_lora'"),
                      ({**shape, "mix_lora": 0}, "mix_lora must be a positive integer"),
                      ({**shape, "hidden": 96}, "not a multiple of head_dim")]:
        with pytest.raises(PipelineError) as e:
            FAM.geometry_from_shape(bad, "config.yaml")
        assert what in one_line(e.value)
    assert FAM.parameter_count(G) == sum(t.numel() for _, t in FAM.synthetic_tensors(G, 0))


def test_decode_skeleton_has_the_linears():
    import torch.nn as nn

    sk = FAM.decode_skeleton(G, torch.float32)
    dec = FAM.build_decode(dict(FAM.synthetic_tensors(G, 0)), G, torch.float32)
    shapes = lambda m: {n: tuple(x.weight.shape) for n, x in m.named_modules() if isinstance(x, nn.Linear)}  # noqa: E731
    assert shapes(sk) == shapes(dec) and all(p.is_meta for p in sk.parameters())


def test_geometry_from_config_errors_and_defaults():
    cfg = FAM.config_json(G)
    assert cfg["model_type"] in FAM.hf_model_types and cfg["head_size_divisor"] == 8
    plain = {k: v for k, v in cfg.items() if k not in ("time_mix_extra_dim", "time_decay_extra_dim", "intermediate_size")}
    g = FAM.geometry_from_config(plain, "config.json")
    assert (g.mix_lora, g.decay_lora, g.ffn) == (32, 64, int(128 * 3.5) // 32 * 32)   # the HF remote code's rule
    g4k = FAM.geometry_from_config({**plain, "hidden_size": 4096, "attention_hidden_size": 4096}, "config.json")
    assert (g4k.mix_lora, g4k.decay_lora) == (64, 128)
    for bad, what in [({**cfg, "model_type": "rwkv7"}, "model_type is 'rwkv7'"),
                      ({k: v for k, v in cfg.items() if k != "hidden_size"}, "missing key 'hidden_size'"),
                      ({**cfg, "num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
                      ({**cfg, "attention_hidden_size": 64}, "attention_hidden_size 64 differs"),
                      ([1, 2], "is a JSON array")]:
        with pytest.raises(PipelineError) as e:
            FAM.geometry_from_config(bad, "config.json")
        assert what in one_line(e.value)


def test_blinkdl_names_match_families_md():
    """The BlinkDL x060 names exactly as families.md lists them (one layer)."""
    g = Geometry(layers=1, hidden=64, ffn=224, vocab=10, mix_lora=4, decay_lora=8)
    names = {layouts.to_blinkdl_name(n): s for n, s in FAM.normal_shapes(g).items()}
    want = {"emb.weight": (10, 64), "blocks.0.ln0.weight": (64,), "blocks.0.ln0.bias": (64,),
            "blocks.0.ln1.weight": (64,), "blocks.0.ln1.bias": (64,), "blocks.0.ln2.weight": (64,),
            "blocks.0.ln2.bias": (64,),
            **{f"blocks.0.att.time_maa_{m}": (1, 1, 64) for m in "xwkvrg"},
            "blocks.0.att.time_maa_w1": (64, 20), "blocks.0.att.time_maa_w2": (5, 4, 64),
            "blocks.0.att.time_decay": (1, 1, 64), "blocks.0.att.time_decay_w1": (64, 8),
            "blocks.0.att.time_decay_w2": (8, 64), "blocks.0.att.time_faaaa": (1, 64),
            **{f"blocks.0.att.{n}.weight": (64, 64) for n in ("receptance", "key", "value", "gate", "output")},
            "blocks.0.att.ln_x.weight": (64,), "blocks.0.att.ln_x.bias": (64,),
            "blocks.0.ffn.time_maa_k": (1, 1, 64), "blocks.0.ffn.time_maa_r": (1, 1, 64),
            "blocks.0.ffn.key.weight": (224, 64), "blocks.0.ffn.receptance.weight": (64, 64),
            "blocks.0.ffn.value.weight": (64, 224), "ln_out.weight": (64,), "ln_out.bias": (64,),
            "head.weight": (10, 64)}
    assert names == want


@pytest.mark.parametrize("layout", FAM.layouts)
def test_generic_reader_reads_both_layouts(sd, layout, tmp_path):
    """checkpoints/reader.py (what the source stage uses) on each layout: geometry, family,
    normal form byte-identical; the streamed normalisation writes the same bytes as the hf file."""
    from recurrent_coreai.checkpoints.reader import read_checkpoint, write_normalized

    path = FAM.write_layout(sd, tmp_path / "src", layout)
    src = path if layout == "blinkdl" else path.parent
    ck = read_checkpoint(src)
    assert ck.layout == layout and ck.geometry == G
    assert_identical(ck.tensors, sd)
    dst = tmp_path / "normal.safetensors"
    write_normalized(src, dst, FAM)
    want = FAM.write_layout(sd, tmp_path / "want", "hf")
    assert dst.read_bytes() == want.read_bytes()


def documented_blinkdl_names(layers: int) -> set[str]:
    """The names of a BlinkDL x060 .pth as /work/shared/knowledge/families.md lists them (not
    the family's own mapping)."""
    names = {"emb.weight", "blocks.0.ln0.weight", "blocks.0.ln0.bias", "ln_out.weight", "ln_out.bias", "head.weight"}
    for i in range(layers):
        b = f"blocks.{i}."
        names |= {f"{b}{ln}.{p}" for ln in ("ln1", "ln2", "att.ln_x") for p in ("weight", "bias")}
        names |= {f"{b}att.time_maa_{x}" for x in ("x", "w", "k", "v", "r", "g", "w1", "w2")}
        names |= {f"{b}att.{x}" for x in ("time_decay", "time_decay_w1", "time_decay_w2", "time_faaaa")}
        names |= {f"{b}att.{m}.weight" for m in ("receptance", "key", "value", "gate", "output")}
        names |= {f"{b}ffn.{x}" for x in ("time_maa_k", "time_maa_r", "key.weight", "receptance.weight", "value.weight")}
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_state_dict_torch_saved_directly_is_read(sd, dtype, tmp_path):
    """BlinkDL's .pth is torch.save of a plain state dict (bf16 in the released files): written
    here by torch.save itself, not by the family's writer, it is read by the checkpoint reader
    (zip CRCs checked, geometry off the tensors) into the normal form, value for value."""
    from recurrent_coreai.checkpoints import reader

    blink = {k: v.to(dtype) for k, v in read_back(FAM.write_layout(sd, tmp_path / "ours", "blinkdl")).items()}
    assert set(blink) == documented_blinkdl_names(G.layers)
    path = tmp_path / "src" / "RWKV-x060-tiny.pth"
    path.parent.mkdir()
    torch.save(blink, path)
    ck = reader.read_checkpoint(path, FAM)
    assert (ck.layout, ck.geometry) == ("blinkdl", G)
    assert_identical(ck.tensors, {k: v.to(dtype) for k, v in sd.items()})
