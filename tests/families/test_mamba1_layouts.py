"""Mamba-1 geometry, config.json styles (transformers mamba / falcon_mamba, mamba_ssm's original),
checkpoint layouts and synthetic weights."""

from __future__ import annotations

import json

import pytest
import torch

from mamba1_common import FAMILY, SHAPES, geometry, weights
from recurrent_coreai.families.mamba1 import layouts
from recurrent_coreai.util.errors import PipelineError


def one_line(exc: PipelineError) -> str:
    text = str(exc)
    assert "\n" not in text
    return text


# the config.json of tiiuae/falcon-mamba-7b as published (expand 16 beside intermediate_size 8192)
FALCON_7B = {"_name_or_path": "./", "architectures": ["FalconMambaForCausalLM"], "bos_token_id": 0, "conv_kernel": 4,
             "eos_token_id": 11, "expand": 16, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.1,
             "intermediate_size": 8192, "layer_norm_epsilon": 1e-05, "model_type": "falcon_mamba",
             "num_hidden_layers": 64, "pad_token_id": 11, "rescale_prenorm_residual": False, "residual_in_fp32": True,
             "state_size": 16, "tie_word_embeddings": False, "time_step_floor": 0.0001,
             "time_step_init_scheme": "random", "time_step_max": 0.1, "time_step_min": 0.001, "time_step_rank": 256,
             "time_step_scale": 1.0, "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0",
             "use_bias": False, "use_cache": True, "use_conv_bias": True, "vocab_size": 65024}
# state-spaces/mamba-2.8b's config.json: mamba_ssm MambaConfig's fields (its defaults are this model)
ORIGINAL_2_8B = {"d_model": 2560, "n_layer": 64, "vocab_size": 50277, "ssm_cfg": {}, "rms_norm": True,
                 "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 8}
# transformers' conversion of the same (state-spaces/mamba-2.8b-hf style)
HF_2_8B = {"model_type": "mamba", "hidden_size": 2560, "num_hidden_layers": 64, "state_size": 16, "expand": 2,
           "conv_kernel": 4, "time_step_rank": "auto", "vocab_size": 50280, "layer_norm_epsilon": 1e-5,
           "use_bias": False, "use_conv_bias": True, "tie_word_embeddings": True}


def test_published_geometries_and_the_shipped_scale_entries():
    import yaml

    f7 = FAMILY.geometry_from_config(json.loads(json.dumps(FALCON_7B)), "config.json")
    assert (f7.layers, f7.hidden, f7.intermediate, f7.d_state, f7.dt_rank, f7.vocab) == (64, 4096, 8192, 16, 256, 65024)
    assert f7.falcon and not f7.tie_embeddings and f7.mixer_eps == 1e-6
    assert 7.26e9 < FAMILY.parameter_count(f7) < 7.28e9        # "7.27B"
    a = FAMILY.geometry_from_config(json.loads(json.dumps(ORIGINAL_2_8B)), "config.json")
    b = FAMILY.geometry_from_config(HF_2_8B, "config.json")
    assert a == b and a.vocab == 50280 and a.dt_rank == 160 and a.intermediate == 5120 and a.tie_embeddings
    assert 2.7e9 < FAMILY.parameter_count(a) < 2.8e9
    models = yaml.safe_load(open("config.yaml"))["models"]
    for entry, want in (("mamba1-2.8b-shape", a), ("falcon-mamba-7b-shape", f7)):
        assert FAMILY.geometry_from_shape(models[entry]["source"]["shape"], entry) == want, entry


def test_config_json_round_trips_and_transformers_agrees():
    from transformers import FalconMambaConfig, MambaConfig

    for name in SHAPES:
        g = geometry(name)
        cfg = FAMILY.config_json(g)
        assert FAMILY.geometry_from_config(cfg, "c") == g
        cls = FalconMambaConfig if g.falcon else MambaConfig
        hc = cls(**{k: v for k, v in cfg.items() if k != "architectures"})
        assert (hc.intermediate_size, hc.time_step_rank, hc.state_size, hc.conv_kernel) == \
            (g.intermediate, g.dt_rank, g.d_state, g.conv_kernel)
        assert hc.model_type == g.model_type


@pytest.mark.parametrize("shape,needle", [
    ({"layers": 2, "hidden": 64, "d_state": 16}, "'vocab' is missing"),
    ({"layers": 2, "hidden": 64, "d_state": 16, "vocab": 9, "heads": 4}, "unknown Mamba-1 shape key 'heads'"),
    ({"layers": 2, "hidden": 64, "d_state": 0, "vocab": 9}, "d_state must be positive"),
    ({"layers": 2.5, "hidden": 64, "d_state": 16, "vocab": 9}, "layers must be an integer"),
    ({"layers": 2, "hidden": 64, "d_state": 16, "vocab": 9, "expand": 2, "intermediate": 100}, "both expand and intermediate"),
    ({"layers": 2, "hidden": 64, "d_state": 16, "vocab": 9, "falcon": 1}, "falcon must be a boolean"),
])
def test_bad_shapes_are_one_line(shape, needle):
    with pytest.raises(PipelineError) as e:
        FAMILY.geometry_from_shape(shape, "config.yaml")
    assert needle in one_line(e.value)


@pytest.mark.parametrize("change,needle", [
    ({"use_bias": True}, "use_bias"),
    ({"use_conv_bias": False}, "use_conv_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"time_step_rank": "half"}, 'time_step_rank must be "auto" or a positive integer'),
    ({"model_type": "mamba2"}, "model_type is 'mamba2'"),
])
def test_bad_hf_configs_are_one_line(change, needle):
    with pytest.raises(PipelineError) as e:
        FAMILY.geometry_from_config({**HF_2_8B, **change}, "config.json")
    assert needle in one_line(e.value) and "config.json" in str(e.value)


@pytest.mark.parametrize("change,needle", [
    ({"ssm_cfg": {"layer": "Mamba2"}}, "this is a Mamba-2 config"),
    ({"d_intermediate": 128}, "d_intermediate"),
    ({"rms_norm": False}, "rms_norm"),
    ({"bogus": 1}, "unknown mamba_ssm config key 'bogus'"),
])
def test_bad_mamba_ssm_configs_are_one_line(change, needle):
    with pytest.raises(PipelineError) as e:
        FAMILY.geometry_from_config({**ORIGINAL_2_8B, **change}, "config.json")
    assert needle in one_line(e.value)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_layout_round_trips(name, tmp_path):
    g = geometry(name)
    sd = weights(g, seed=2)
    for layout in FAMILY.layouts:
        if layout == "mamba-ssm" and (g.falcon or not g.tie_embeddings):
            with pytest.raises(ValueError, match="plain Mamba-1 with a tied head"):
                FAMILY.write_layout(sd, tmp_path / layout, layout, geom=g)
            assert not (tmp_path / layout).exists()    # refused before anything is written
            continue
        FAMILY.write_layout(sd, tmp_path / layout, layout, geom=g)
        g2, normal, got = layouts.read_dir(tmp_path / layout)
        assert (g2, got) == (g, layout)
        assert list(normal) == list(FAMILY.normal_shapes(g))
        assert all(torch.equal(normal[n], sd[n]) for n in sd)


def test_streamed_hf_write_is_the_same_bytes(tmp_path):
    g = geometry("falcon")
    FAMILY.write_synthetic(g, 7, tmp_path / "a", "hf")
    FAMILY.write_layout(dict(FAMILY.synthetic_tensors(g, 7)), tmp_path / "b", "hf", geom=g)
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()


def test_an_x_proj_that_disagrees_with_the_config_names_both_numbers(tmp_path):
    g = geometry("untied-rank")
    FAMILY.write_layout(weights(g), tmp_path, "hf", geom=g)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["time_step_rank"] = 9   # x_proj was made for dt_rank 7
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PipelineError) as e:
        layouts.read_dir(tmp_path)
    assert "x_proj.weight" in one_line(e.value) and "9 + 2*12" in str(e.value)


def test_detects_only_mamba1_names():
    g = geometry("tied-auto")
    names = list(FAMILY.normal_shapes(g))
    assert FAMILY.detect_layout(names) == "hf"
    assert FAMILY.detect_layout([n.replace("embeddings", "embedding") for n in names]) == "mamba-ssm"
    assert FAMILY.detect_layout([n for n in names if "x_proj" not in n]) is None
    from recurrent_coreai.families import get

    m2 = get("mamba2")
    assert m2.detect_layout(names) is None
    assert FAMILY.detect_layout(m2.normal_shapes(m2.geometry_from_shape(m2.tiny_shape, "t"))) is None


def test_synthetic_weights_are_deterministic_and_tied_heads_equal():
    g = geometry("tied-auto")
    a, b = weights(g, seed=5), weights(g, seed=5)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert torch.equal(a["lm_head.weight"], a["backbone.embeddings.weight"])
    assert not torch.equal(weights(g, seed=6)["backbone.norm_f.weight"], a["backbone.norm_f.weight"])
