"""The Mamba-2 reference against transformers' Mamba2ForCausalLM (pure-torch CPU path), and
copies of the reference with one term broken, which must fail the same comparison.

The HF model is loaded with from_pretrained from the ``hf`` layout our write_layout wrote; the
reference runs on the weights read back from the ``mamba-ssm`` layout (so both layout mappings
are in the loop). Compared: logits of every token (HF's chunked forward over the whole sequence
and HF's step-by-step cache path) and both states after the last token (HF's cache layout is
ours: conv [1, conv_dim, K] newest last, ssm [1, H, P, N]).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from mamba2_common import FAMILY, SHAPES, geometry, tokens, weights
from ssm_common import broken_reference, deltas, hf_run
from recurrent_coreai.families.mamba2 import layouts, reference

N_TOKENS = 64
TOL = 1e-4          # measured ~1e-5 (fp32)
BROKEN_MIN = 1e-2   # a broken term must move something by far more than that


@pytest.fixture(scope="module", params=sorted(SHAPES))
def case(request, tmp_path_factory):
    from transformers import Mamba2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    g = geometry(request.param)
    sd = weights(g, seed=3)
    root = tmp_path_factory.mktemp(f"m2-{request.param}")
    FAMILY.write_layout(sd, root / "hf", "hf", geom=g)
    FAMILY.write_layout(sd, root / "ssm", "mamba-ssm", geom=g)
    g2, normal, layout = layouts.read_dir(root / "ssm")
    assert layout == "mamba-ssm" and g2 == g
    model = Mamba2ForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    toks = tokens(N_TOKENS, g.vocab)
    hf = hf_run(model, toks, g.layers)
    return request.param, g, normal, toks, hf


def test_reference_matches_transformers(case):
    name, g, normal, toks, hf = case
    d = deltas(FAMILY.reference(normal, g), toks, hf)
    print(f"\nreference vs transformers, shape {name}, {N_TOKENS} tokens, fp32: {d}")
    assert max(d.values()) < TOL, d
    d64 = deltas(FAMILY.reference(normal, g, torch.float64), toks, hf)
    print(f"fp64 reference vs transformers fp32: {d64}")
    assert max(d64.values()) < TOL, d64


def test_state_specs_match_bundle_states(case):
    name, g, normal, toks, hf = case
    ref = FAMILY.reference(normal, g)
    _, state = ref.run(toks[:3])
    got = ref.bundle_states(state)
    for spec in FAMILY.state_specs(g):
        assert got[spec.name].shape == spec.shape and got[spec.name].dtype == np.float32


# One term broken per copy: (what, exact source text, its replacement). Each text must occur once.
BREAKS = [
    ("D skip dropped", ' + w[p + "mixer.D"][:, None] * xs', ""),
    ("decay sign flipped", "A = -torch.exp(", "A = torch.exp("),
    ("gated norm eps 1e-5 -> 1e-2", "rms_norm(y.reshape(G, I // G), 1.0, g.norm_eps)",
     "rms_norm(y.reshape(G, I // G), 1.0, 1e-2)"),
    ("block norm eps 1e-5 -> 1e-2", 'h = rms_norm(x, w[p + "norm.weight"], g.norm_eps)',
     'h = rms_norm(x, w[p + "norm.weight"], 1e-2)'),
    ("group broadcast interleaved", ".reshape(G, N).repeat_interleave(H // G, dim=0)      # [H, N]",
     ".reshape(G, N).repeat(H // G, 1)      # [H, N]"),
]


@pytest.mark.parametrize("what,old,new", BREAKS, ids=[b[0] for b in BREAKS])
def test_broken_reference_fails(case, what, old, new):
    name, g, normal, toks, hf = case
    if what.startswith("group") and g.n_groups == 1:
        pytest.skip("one group: nothing to interleave")
    d = deltas(broken_reference(reference, old, new)(normal, g), toks, hf)
    print(f"\n{what}, shape {name}: {d}")
    assert max(d.values()) > BROKEN_MIN, (what, d)
