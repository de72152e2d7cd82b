"""The Mamba-1 reference against transformers' MambaForCausalLM and FalconMambaForCausalLM (their
pure-torch CPU path), and copies of the reference with one term broken, which must fail the same
comparison.

The HF model is loaded with from_pretrained from the ``hf`` layout our write_layout wrote (its
config.json: model_type mamba or falcon_mamba); for a tied plain Mamba the reference runs on the
weights read back from the ``mamba-ssm`` layout (so both layout mappings are in the loop).
Compared: logits of every token (HF's forward over the whole sequence and HF's step-by-step cache
path) and both states after the last token (HF's cache layout is ours: conv [1, I, K] newest last,
ssm [1, I, N]).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from mamba1_common import FAMILY, SHAPES, geometry, tokens, weights
from ssm_common import broken_reference, deltas, hf_run
from recurrent_coreai.families.mamba1 import layouts, reference

N_TOKENS = 64
TOL = 1e-4          # measured ~5e-6 (fp32)
BROKEN_MIN = 1e-2   # a broken term must move something by far more than that


@pytest.fixture(scope="module", params=sorted(SHAPES))
def case(request, tmp_path_factory):
    from transformers import FalconMambaForCausalLM, MambaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    g = geometry(request.param)
    sd = weights(g, seed=3)
    root = tmp_path_factory.mktemp(f"m1-{request.param}")
    FAMILY.write_layout(sd, root / "hf", "hf", geom=g)
    g_hf, normal, layout = layouts.read_dir(root / "hf")
    assert layout == "hf" and g_hf == g
    if g.tie_embeddings and not g.falcon:
        FAMILY.write_layout(sd, root / "ssm", "mamba-ssm", geom=g)
        g2, normal, layout = layouts.read_dir(root / "ssm")
        assert layout == "mamba-ssm" and g2 == g
    cls = FalconMambaForCausalLM if g.falcon else MambaForCausalLM
    model = cls.from_pretrained(root / "hf", dtype=torch.float32).eval()
    assert type(model).__name__ == ("FalconMambaForCausalLM" if g.falcon else "MambaForCausalLM")
    assert model.config.time_step_rank == g.dt_rank and model.config.intermediate_size == g.intermediate
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
    ("softplus dropped", 'dt = F.softplus(w[p + "dt_proj.weight"] @ d + w[p + "dt_proj.bias"])',
     'dt = (w[p + "dt_proj.weight"] @ d + w[p + "dt_proj.bias"])'),
    ("conv window off by one", 'torch.cat([state["conv"][i, :, 1:], u[:, None]], dim=1)',
     'torch.cat([state["conv"][i, :, :-1], u[:, None]], dim=1)'),
    ("sign of A flipped", "A = -torch.exp(", "A = torch.exp("),
    ("Falcon B/C/dt norms dropped", "if g.falcon:", "if False:"),
    ("D skip dropped", ' + w[p + "D"] * u', ""),
    ("block norm eps -> 1e-2", 'h = rms_norm(x, w[f"backbone.layers.{i}.norm.weight"], g.norm_eps)',
     'h = rms_norm(x, w[f"backbone.layers.{i}.norm.weight"], 1e-2)'),
]


@pytest.mark.parametrize("what,old,new", BREAKS, ids=[b[0] for b in BREAKS])
def test_broken_reference_fails(case, what, old, new):
    name, g, normal, toks, hf = case
    if what.startswith("Falcon") and not g.falcon:
        pytest.skip("a plain Mamba: no B/C/dt norms to drop")
    d = deltas(broken_reference(reference, old, new)(normal, g), toks, hf)
    print(f"\n{what}, shape {name}: {d}")
    assert max(d.values()) > BROKEN_MIN, (what, d)
