"""Mamba-2 geometry, config.json styles, checkpoint layouts and synthetic weights."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mamba2_common import FAMILY, SHAPES, geometry, weights
from recurrent_coreai.families.mamba2 import layouts
from recurrent_coreai.families.mamba2.geometry import Geometry
from recurrent_coreai.util.errors import PipelineError


def one_line(exc: PipelineError) -> str:
    text = str(exc)
    assert "\n" not in text
    return text


# --- geometry -----------------------------------------------------------------------------
def test_derived_sizes():
    g = FAMILY.geometry_from_shape({"layers": 24, "hidden": 768, "d_state": 128, "headdim": 64, "vocab": 50288}, "s")
    assert (g.intermediate, g.heads, g.conv_dim, g.in_proj_width) == (1536, 24, 1792, 3352)
    assert FAMILY.geometry_from_dict(g.as_dict()) == g
    # mamba2-130m: 24 x (in_proj 3352x768 + out_proj 768x1536 + ...) + tied 50288x768 (materialised: counted twice)
    assert FAMILY.parameter_count(g) == sum(math.prod(s) for s in FAMILY.normal_shapes(g).values())


@pytest.mark.parametrize("shape,needle", [
    ({"layers": 2, "hidden": 64, "d_state": 16, "headdim": 16}, "'vocab' is missing"),
    ({"layers": 2, "hidden": 64, "d_state": 16, "headdim": 16, "vocab": 9, "heads": 4}, "unknown Mamba-2 shape key 'heads'"),
    ({"layers": 2, "hidden": 64, "d_state": 16, "headdim": 48, "vocab": 9}, "not a multiple of headdim 48"),
    ({"layers": 2, "hidden": 64, "d_state": 16, "headdim": 16, "vocab": 9, "n_groups": 3}, "not a multiple of n_groups 3"),
    ({"layers": 2, "hidden": 64, "d_state": 0, "headdim": 16, "vocab": 9}, "d_state must be positive"),
    ({"layers": 2.5, "hidden": 64, "d_state": 16, "headdim": 16, "vocab": 9}, "layers must be an integer"),
])
def test_bad_shapes_are_one_line(shape, needle):
    with pytest.raises(PipelineError) as e:
        FAMILY.geometry_from_shape(shape, "config.yaml")
    assert needle in one_line(e.value)


def hf_cfg(**over):
    cfg = {"model_type": "mamba2", "hidden_size": 768, "num_hidden_layers": 24, "state_size": 128, "head_dim": 64,
           "num_heads": 24, "n_groups": 1, "expand": 2, "conv_kernel": 4, "vocab_size": 50288,
           "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, "use_bias": False, "use_conv_bias": True,
           "time_step_limit": [0.0, float("inf")]}
    cfg.update(over)
    return cfg


# the config.json of state-spaces/mamba2-130m (as released)
ORIGINAL_130M = {"d_model": 768, "d_intermediate": 0, "n_layer": 24, "vocab_size": 50277, "ssm_cfg": {"layer": "Mamba2"},
                 "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
                 "fused_add_norm": True, "pad_vocab_size_multiple": 16, "tie_embeddings": True}


def test_both_config_styles_give_the_same_geometry():
    a = FAMILY.geometry_from_config(hf_cfg(), "config.json")
    b = FAMILY.geometry_from_config(json.loads(json.dumps(ORIGINAL_130M)), "config.json")
    assert a == b
    assert 128e6 < FAMILY.parameter_count(b) < 131e6   # "mamba2-130m": the tied head counted once
    assert b.vocab == 50288 and b.tie_embeddings  # padded to a multiple of 16, tied by default
    g = geometry("g4-tied")
    assert FAMILY.geometry_from_config(FAMILY.config_json(g), "c") == g
    # transformers' own config class accepts what config_json writes and agrees on the sizes
    from transformers import Mamba2Config

    hc = Mamba2Config(**{k: v for k, v in FAMILY.config_json(g).items() if k != "architectures"})
    assert (hc.num_heads, hc.head_dim, hc.n_groups, hc.state_size) == (g.heads, g.headdim, g.n_groups, g.d_state)


# time_step_limit / dt_limit [0, infinity] in every spelling a writer uses: Python's json (bare
# Infinity; 1e309 reads as inf), transformers 5's tagged object, a -Infinity lower bound
NO_CLAMP = {
    "python-float": [0.0, float("inf")],
    "bare-Infinity-token": json.loads("[0.0, Infinity]"),
    "1e309": json.loads("[0, 1e309]"),
    "transformers-5-tag": [0.0, {"__float__": "Infinity"}],
    "both-tagged": [{"__float__": "-Infinity"}, {"__float__": "Infinity"}],
}
# a clamp, or what no writer means as infinity (transformers decodes only its exact tags)
CLAMPS = {
    "upper-clamp": [0.0, 0.1],
    "lower-clamp": [0.001, {"__float__": "Infinity"}],
    "largest-finite": [0.0, 1e308],
    "string-inf": [0.0, "inf"],
    "nan-tag": [0.0, {"__float__": "NaN"}],
    "tag-plus-key": [0.0, {"__float__": "Infinity", "x": 1}],
    "lowercase-tag": [0.0, {"__float__": "infinity"}],
    "boolean": [False, True],
    "three-values": [0.0, float("inf"), 1.0],
}


@pytest.mark.parametrize("spelling", list(NO_CLAMP))
def test_no_dt_clamp_in_every_spelling_is_accepted(spelling):
    v = NO_CLAMP[spelling]
    assert FAMILY.geometry_from_config(hf_cfg(time_step_limit=v), "config.json") == \
        FAMILY.geometry_from_config(hf_cfg(), "config.json")
    ssm = {**ORIGINAL_130M, "ssm_cfg": {"layer": "Mamba2", "dt_limit": v}}
    assert FAMILY.geometry_from_config(ssm, "config.json") == FAMILY.geometry_from_config(ORIGINAL_130M, "c")


def test_transformers_own_config_json_is_accepted(tmp_path):
    """The file Mamba2Config.save_pretrained writes (transformers 5: {"__float__": "Infinity"})."""
    from transformers import Mamba2Config

    Mamba2Config(hidden_size=64, num_hidden_layers=2, state_size=16, head_dim=16, num_heads=8, n_groups=1,
                 vocab_size=320).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    g = FAMILY.geometry_from_config(written, tmp_path / "config.json")
    assert (g.hidden, g.layers, g.d_state, g.headdim, g.heads, g.vocab) == (64, 2, 16, 16, 8, 320)


@pytest.mark.parametrize("spelling", list(CLAMPS))
def test_a_dt_clamp_or_unknown_spelling_is_refused(spelling):
    with pytest.raises(PipelineError) as e:
        FAMILY.geometry_from_config(hf_cfg(time_step_limit=CLAMPS[spelling]), "config.json")
    assert f"time_step_limit is {json.dumps(CLAMPS[spelling])}; this Mamba-2 port supports only time_step_limit " \
        "[0, Infinity]" in one_line(e.value)


@pytest.mark.parametrize("cfg,needle", [
    (hf_cfg(num_heads=12), "num_heads is 12 but expand*hidden/head_dim = 1536/64 = 24"),
    (hf_cfg(use_bias=True), "use_bias is true"),
    (hf_cfg(time_step_limit=[0.0, 0.1]), "time_step_limit"),
    ({k: v for k, v in hf_cfg().items() if k != "state_size"}, "missing key 'state_size'"),
    (hf_cfg(model_type="mamba"), "model_type is 'mamba'"),
    ({**ORIGINAL_130M, "ssm_cfg": {}}, 'ssm_cfg.layer is "Mamba1"'),
    ({**ORIGINAL_130M, "d_intermediate": 128}, "d_intermediate is 128"),
    ({**ORIGINAL_130M, "ssm_cfg": {"layer": "Mamba2", "ngroups": "two"}}, "ssm_cfg.ngroups must be a positive integer"),
    ({**ORIGINAL_130M, "ssm_cfg": {"layer": "Mamba2", "bogus": 1}}, "unknown key ssm_cfg.'bogus'"),
    ({**ORIGINAL_130M, "extra": 1}, "unknown mamba_ssm config key 'extra'"),
    ([1, 2], "not an object"),
])
def test_bad_configs_are_one_line(cfg, needle):
    with pytest.raises(PipelineError) as e:
        FAMILY.geometry_from_config(cfg, "config.json")
    assert needle in one_line(e.value)


# --- layouts ------------------------------------------------------------------------------
def _bytes(sd: dict) -> dict[str, bytes]:
    return {n: t.contiguous().numpy().tobytes() for n, t in sd.items()}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_layouts_normalise_to_identical_bytes(tmp_path, name):
    g = geometry(name)
    sd = weights(g)
    normal = _bytes(sd)
    assert list(normal) == list(FAMILY.normal_shapes(g))
    for layout in FAMILY.layouts:
        path = FAMILY.write_layout(sd, tmp_path / layout, layout, geom=g)
        assert path.name == layouts.WEIGHT_FILES[layout]
        g2, got, detected = layouts.read_dir(tmp_path / layout)
        assert (g2, detected) == (g, layout)
        assert list(got) == list(normal), layout
        assert _bytes(got) == normal, layout
    hf_names = set(__import__("safetensors.torch").torch.load_file(tmp_path / "hf" / "model.safetensors"))
    ssm_names = set(torch.load(tmp_path / "mamba-ssm" / "pytorch_model.bin", weights_only=True))
    assert ("lm_head.weight" in hf_names) == (not g.tie_embeddings)   # transformers omits a tied head
    assert "lm_head.weight" in ssm_names and "backbone.embedding.weight" in ssm_names  # as mamba_ssm saves
    assert FAMILY.detect_layout(hf_names) == "hf" and FAMILY.detect_layout(ssm_names) == "mamba-ssm"
    assert FAMILY.detect_layout(["model.layers.0.attn.r_proj.weight"]) is None


def test_meta_tensors_normalise(tmp_path):
    g = geometry("g4-tied")
    with torch.device("meta"):
        sd = {n: torch.empty(s) for n, s in FAMILY.normal_shapes(g).items() if n != "lm_head.weight"}
    out = FAMILY.normalize(sd, g, "x")
    assert {n: tuple(t.shape) for n, t in out.items()} == FAMILY.normal_shapes(g)


@pytest.fixture
def g1_sd():
    g = geometry("g1")
    return g, weights(g)


def _raises(sd, g, needle):
    with pytest.raises(PipelineError) as e:
        FAMILY.normalize(sd, g, "ckpt/model.safetensors")
    assert needle in one_line(e.value), str(e.value)


def test_missing_tensor(g1_sd):
    g, sd = g1_sd
    del sd["backbone.layers.1.mixer.D"]
    _raises(sd, g, "tensor backbone.layers.1.mixer.D is missing (expected shape [8])")


def test_missing_untied_head(g1_sd):
    g, sd = g1_sd
    del sd["lm_head.weight"]
    _raises(sd, g, "tensor lm_head.weight is missing (expected shape [256, 64])")


def test_extra_tensor(g1_sd):
    g, sd = g1_sd
    sd["backbone.layers.0.mixer.x_proj.weight"] = torch.zeros(3, 3)
    _raises(sd, g, "unexpected tensor backbone.layers.0.mixer.x_proj.weight (shape [3, 3]")


def test_misshaped_tensor(g1_sd):
    g, sd = g1_sd
    sd["backbone.layers.0.mixer.conv1d.weight"] = torch.zeros(192, 1, 4)
    _raises(sd, g, "tensor backbone.layers.0.mixer.conv1d.weight has shape [192, 1, 4], expected [160, 1, 4]")


def test_inconsistent_in_proj_width(g1_sd):
    """Weights of n_groups 2 under a config that says 1: the in_proj width names both numbers."""
    g, _ = g1_sd
    wrong = Geometry(**{**g.as_dict(), "n_groups": 2})
    sd = weights(wrong)
    _raises(sd, g, "in_proj.weight has 328 output rows, but config.json implies 2*I + 2*G*N + H = "
            "2*128 + 2*1*16 + 8 = 296 (d_state 16, n_groups 1, head_dim 16)")


def test_tied_head_must_equal_embedding():
    g = geometry("g4-tied")
    sd = weights(g)
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    _raises(sd, g, "tensor lm_head.weight differs from the tied embedding")


# --- synthetic ----------------------------------------------------------------------------
SCRIPT = """
import hashlib, sys, tempfile, pathlib
from recurrent_coreai.families import get
F = get("mamba2")
g = F.geometry_from_shape({"layers": 2, "hidden": 48, "d_state": 24, "headdim": 12, "vocab": 300, "n_groups": 4}, "s")
d = pathlib.Path(tempfile.mkdtemp())
for layout in F.synthetic_layouts:
    p = F.write_layout(dict(F.synthetic_tensors(g, 7)), d / layout, layout, geom=g)
    print(layout, hashlib.sha256(p.read_bytes()).hexdigest(), hashlib.sha256((d / layout / "config.json").read_bytes()).hexdigest())
"""


def test_synthetic_same_bytes_in_two_processes():
    runs = [subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0].splitlines()) == 2
    g = geometry("g1")
    assert _bytes(weights(g, 1)) != _bytes(weights(g, 2))


def test_synthetic_ranges_and_peaked_logits():
    g = geometry("g1")
    sd = weights(g)
    for i in range(g.layers):
        p = f"backbone.layers.{i}.mixer."
        A = torch.exp(sd[p + "A_log"])
        assert 1.0 <= A.min() and A.max() <= 16.0
        dt = torch.nn.functional.softplus(sd[p + "dt_bias"])
        assert 1e-3 * 0.99 <= dt.min() and dt.max() <= 1e-1 * 1.01
    ref = FAMILY.reference(sd, g)
    logits, _ = ref.run(list(range(40)))
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1])
    assert float(margin.median()) > 0.1, margin   # clear top-1 at most steps


# --- a tied head through the source stage: every route gives the normal form (lm_head materialised)
def test_a_tied_head_left_out_by_the_hf_layout_is_materialised_by_the_source_stage(tmp_path, cfg):
    """Hugging Face saves a tied Mamba-2 without ``lm_head.weight``; the normal form always holds it.
    The synthetic source in either layout and a path source holding the HF file must all give the
    same normal-form bytes (a copy of the HF file as it is would miss the head: the export's
    ``KeyError: 'lm_head.weight'``)."""
    import copy

    from safetensors import safe_open

    from recurrent_coreai.stages.source import build_source

    model = copy.deepcopy(cfg["models"]["mamba2-tiny"])
    assert model["source"]["shape"]["tie_embeddings"] is True
    outs = {}
    for layout in ("mamba-ssm", "hf"):
        model["source"]["layout"] = layout
        outs[layout] = tmp_path / layout / "source"
        build_source("mamba2-tiny", model, cfg["vocab"], outs[layout])
    hf_file = tmp_path / "hf-file"
    g = FAMILY.geometry_from_shape(model["source"]["shape"], "config.yaml")
    FAMILY.write_synthetic(g, model["source"]["seed"], hf_file, "hf")
    with safe_open(hf_file / "model.safetensors", "pt") as fh:
        assert "lm_head.weight" not in fh.keys()  # as transformers writes a tied model
    for name in ("tokenizer.json",):
        (hf_file / name).write_bytes((outs["hf"] / name).read_bytes())
    path_model = {**model, "source": {"kind": "path", "path": str(hf_file)}}
    outs["path"] = tmp_path / "path" / "source"
    build_source("mamba2-tiny", path_model, cfg["vocab"], outs["path"])
    digests = {k: hashlib.sha256((v / "model.safetensors").read_bytes()).hexdigest() for k, v in outs.items()}
    assert len(set(digests.values())) == 1, digests
    with safe_open(outs["hf"] / "model.safetensors", "pt") as fh:
        head, emb = fh.get_tensor("lm_head.weight"), fh.get_tensor("backbone.embeddings.weight")
    assert torch.equal(head, emb)


# --- files transformers itself wrote, through the source stage ---------------------------------
HF_TINY = {"hidden_size": 64, "num_hidden_layers": 2, "state_size": 16, "head_dim": 16, "num_heads": 8,
           "n_groups": 2, "vocab_size": 320, "conv_kernel": 4, "expand": 2}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("how", ["save_pretrained", "torch.save-bin"])
def test_a_checkpoint_transformers_saved_goes_through_the_source_stage(tmp_path, cfg, how, tied):
    """A tiny Mamba2ForCausalLM saved by transformers 5's save_pretrained (model.safetensors, a
    tied head left out, config.json with time_step_limit [0.0, {"__float__": "Infinity"}]), or its
    state dict written by torch.save as pytorch_model.bin (as transformers 4 saved with
    safe_serialization=False: transformers 5 ignores that flag and writes safetensors), is read by
    the source stage, and the normalised weights equal what the transformers model holds."""
    from safetensors import safe_open
    from transformers import Mamba2Config, Mamba2ForCausalLM

    from recurrent_coreai import tokenizers
    from recurrent_coreai.stages.source import build_source

    torch.manual_seed(5)
    model = Mamba2ForCausalLM(Mamba2Config(**HF_TINY, tie_word_embeddings=tied)).eval()
    src = tmp_path / "hf"
    model.save_pretrained(src, safe_serialization=how == "save_pretrained")
    assert json.loads((src / "config.json").read_text())["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    if how == "torch.save-bin":
        (src / "model.safetensors").unlink()
        torch.save(model.state_dict(), src / "pytorch_model.bin")
    assert sorted(p.name for p in src.glob("*.safetensors")) == (["model.safetensors"] if how == "save_pretrained"
                                                                 else [])
    tokenizers.kind(FAMILY.tokenizer).source_files(src, {**cfg["vocab"], "vocab_size": HF_TINY["vocab_size"]})
    out = tmp_path / "source"
    spec = {"family": "mamba2", "source": {"kind": "path", "path": str(src)}, "license": "apache-2.0"}
    manifest = build_source("hf-saved", spec, cfg["vocab"], out)
    assert manifest["layout"] == "hf"
    held = {k: v.detach() for k, v in model.state_dict().items()}
    assert "lm_head.weight" in held
    with safe_open(out / "model.safetensors", "pt") as fh:
        assert sorted(fh.keys()) == sorted(held)
        for name, want in held.items():
            assert torch.equal(fh.get_tensor(name), want), name
    g = FAMILY.geometry_from_dict(manifest["geometry"])
    assert (g.hidden, g.layers, g.n_groups, g.vocab, g.tie_embeddings) == (64, 2, 2, 320, tied)
