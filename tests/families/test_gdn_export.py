"""Gated DeltaNet: the chunk form is exact, the layouts normalise (and refuse) as stated, fla's
config.json is read as fla reads it. (fla itself: test_gdn_official.py; the Core AI runtime:
test_gdn_coreai.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from recurrent_coreai import families
from recurrent_coreai.checkpoints import reader
from recurrent_coreai.families.gdn import recurrence as rec
from recurrent_coreai.families.gdn.geometry import geometry_from_config, mlp_width
from recurrent_coreai.util.errors import PipelineError

FAMILY = families.get("gdn")
SHAPES = {
    "gva": FAMILY.tiny_shape,   # 4 value heads over 2 q/k heads, expand_v 2, beta x 2
    "plain": {"layers": 3, "hidden": 48, "heads": 3, "head_dim": 8, "vocab": 300, "intermediate": 96,
              "conv_size": 3, "use_gate": False, "tie_embeddings": True},
}


def _geom(name):
    return FAMILY.geometry_from_shape(SHAPES[name], name)


def _tokens(n, vocab, seed=1):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _call(module, toks):
    x = torch.tensor([toks], dtype=torch.int32)
    return module(x, torch.zeros_like(x)).reshape(-1).double()


@pytest.mark.parametrize("T", [1, 2, 7, 16, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_chunk_form_equals_the_token_loop(T, dtype):
    gen = torch.Generator().manual_seed(T)
    Hv, K, V = 3, 8, 5
    q = rec.l2norm(torch.randn(Hv, T, K, generator=gen, dtype=torch.float64)) / K ** 0.5
    k = rec.l2norm(torch.randn(Hv, T, K, generator=gen, dtype=torch.float64))
    v = torch.randn(Hv, T, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(Hv, T, generator=gen, dtype=torch.float64) * 2
    b = torch.rand(Hv, T, generator=gen, dtype=torch.float64) * 2      # up to 2: allow_neg_eigval
    S0 = torch.randn(Hv, K, V, generator=gen, dtype=torch.float64)
    S, outs = S0.clone(), []
    for t in range(T):
        o, S = rec.delta_step(S, q[:, t], k[:, t], v[:, t], g[:, t], b[:, t])
        outs.append(o)
    O, S_T = rec.chunk(*(x.to(dtype) for x in (S0, q, k, v, g, b)))
    tol = 1e-11 if dtype == torch.float64 else 2e-5 * max(1.0, T ** 0.5)
    assert (O.double() - torch.stack(outs, 1)).abs().max() < tol
    assert (S_T.double() - S).abs().max() < tol


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("T", [1, 7, 16, 64])
def test_prefill_equals_decode_steps(shape, T):
    g = _geom(shape)
    w = dict(FAMILY.synthetic_tensors(g, 3))
    toks = _tokens(T + 5, g.vocab)
    dec = FAMILY.build_decode(w, g, torch.float64)
    steps = [_call(dec, [t]) for t in toks[:T]]
    want = {s.name: getattr(dec, s.name).clone() for s in FAMILY.state_specs(g)}
    dec.reset()
    got = _call(FAMILY.build_prefill(dec, T), toks[:T])
    assert (got - steps[-1]).abs().max() < 1e-10
    for name, state in want.items():
        assert (getattr(dec, name) - state).abs().max() < 1e-10, name


def test_prefill_across_chunk_boundaries_then_decode_equals_the_reference():
    g = _geom("gva")
    w = dict(FAMILY.synthetic_tensors(g, 5))
    toks = _tokens(16 * 3 + 9, g.vocab, 4)
    ref = FAMILY.reference(w, g, torch.float64)
    want, state = ref.run(toks)
    dec = FAMILY.build_decode(w, g, torch.float32)
    pre = FAMILY.build_prefill(dec, 16)
    got = [_call(pre, toks[16 * c:16 * (c + 1)]) for c in range(3)]
    got += [_call(dec, [t]) for t in toks[48:]]
    assert max(float((a - want[16 * c + 15]).abs().max()) for c, a in enumerate(got[:3])) < 1e-4
    assert max(float((a - b).abs().max()) for a, b in zip(got[3:], want[48:])) < 1e-4
    ref_states = ref.bundle_states(state)
    for s in FAMILY.state_specs(g):
        assert float((getattr(dec, s.name).double() - torch.from_numpy(ref_states[s.name]).double()).abs().max()) < 1e-4


# --- layouts ------------------------------------------------------------------------------
def _write(tmp_path, shape, layout, seed=2):
    g = _geom(shape)
    w = dict(FAMILY.synthetic_tensors(g, seed))
    FAMILY.write_layout(w, tmp_path, layout, g)
    return g, w


@pytest.mark.parametrize("shape,layout", [("gva", "fla"), ("gva", "fla-zero-d"), ("plain", "fla-tied"),
                                          ("plain", "fla-zero-d")])
def test_each_layout_streams_to_the_normal_form(tmp_path, shape, layout):
    g, w = _write(tmp_path / "src", shape, layout)
    ck = reader.write_normalized(tmp_path / "src", tmp_path / "normal.safetensors", FAMILY)
    assert ck.layout == layout and ck.geometry == g
    import safetensors.torch

    got = safetensors.torch.load_file(str(tmp_path / "normal.safetensors"))
    assert sorted(got) == sorted(w) and all(torch.equal(got[n], w[n]) for n in w)


def test_a_nonzero_attn_D_is_refused_naming_the_tensor(tmp_path):
    import safetensors.torch

    g, _ = _write(tmp_path, "gva", "fla-zero-d")
    sd = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    sd["model.layers.1.attn.D"][2] = 0.5
    safetensors.torch.save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(PipelineError) as e:
        reader.write_normalized(tmp_path, tmp_path / "out.safetensors", FAMILY)
    assert str(e.value).startswith(f"{tmp_path / 'model.safetensors'}: tensor model.layers.1.attn.D is not all zero")
    assert "\n" not in str(e.value)


def test_an_unexpected_tensor_is_refused_naming_it(tmp_path):
    import safetensors.torch

    _write(tmp_path, "gva", "fla")
    sd = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    sd["model.layers.0.attn.extra_bias"] = torch.zeros(3)
    safetensors.torch.save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(PipelineError, match=r"unexpected tensor model\.layers\.0\.attn\.extra_bias"):
        reader.read_checkpoint(tmp_path, FAMILY)


def _fla_config(**over):
    cfg = {"model_type": "gated_deltanet", "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "head_dim": 16,
           "expand_v": 1.0, "vocab_size": 512, "attn": None, "hidden_ratio": 4, "intermediate_size": None,
           "norm_eps": 1e-6, "conv_size": 4, "use_short_conv": True, "use_gate": True, "fuse_norm": True,
           "fuse_swiglu": True, "attn_mode": "chunk"}
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("over,message", [
    ({"attn": {"layers": [1], "num_heads": 4}}, "keeps a KV cache"),
    ({"use_short_conv": False}, "use_short_conv is false"),
    ({"hidden_act": "gelu"}, 'hidden_act is "gelu"'),
    ({"attnres_block_size": 2}, "attnres_block_size is 2"),
    ({"model_type": "gated_deltaproduct"}, "not 'gated_deltanet'"),
    ({"num_v_heads": 3}, "v_heads 3 is not a multiple of heads 2"),
    ({"expand_v": 0.3}, "is not a whole number"),
    ({"head_dim": 0}, "head_dim must be a positive integer"),
])
def test_fla_config_values_this_port_does_not_build_are_one_line(over, message):
    with pytest.raises(PipelineError) as e:
        geometry_from_config(_fla_config(**over), "config.json")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_fla_mlp_width_rule_and_the_published_geometry():
    assert mlp_width(64, 4, None) == 256            # int(64*4*2/3) = 170 -> 256
    assert mlp_width(2048, 4, None) == 5632         # m-a-p 1.3B: 5461 -> 5632
    assert mlp_width(2048, 4, 5000) == 5000
    g = geometry_from_config(_fla_config(hidden_size=2048, num_hidden_layers=24, num_heads=8, head_dim=256,
                                         vocab_size=32000), "config.json")
    assert (g.intermediate, g.hv, g.head_v_dim, g.key_dim) == (5632, 8, 256, 2048)
    assert 1.3e9 < FAMILY.parameter_count(g) < 1.5e9


@pytest.mark.parametrize("shape,layout", [("gva", "fla"), ("gva", "fla-zero-d"), ("plain", "fla-tied"),
                                          ("plain", "fla-zero-d")])
def test_the_streamed_synthetic_writer_writes_the_bytes_of_write_layout(tmp_path, shape, layout):
    g = _geom(shape)
    FAMILY.write_layout(dict(FAMILY.synthetic_tensors(g, 9)), tmp_path / "whole", layout, g)
    FAMILY.write_synthetic(g, 9, tmp_path / "streamed", layout)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "streamed" / name).read_bytes(), name
