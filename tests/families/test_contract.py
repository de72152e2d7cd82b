"""The Family contract, run once for every registered family (recurrent_coreai.families.available()).

What every stage relies on, whatever the architecture: synthetic weights are deterministic; every
accepted layout normalises to the same normal form; the decode module equals the family's
reference over >= 64 steps; one prefill chunk equals T decode steps (last logits and every
state); each state is written exactly once per call in both functions; the state specs are the
module's buffers. Each family's deeper tests (official implementation, broken copies, Core AI)
live beside this file. Each family states its own tiny shape (``Family.tiny_shape``, in its
``__init__.py``): every per-family test builds from it, and the test fails for a family without one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recurrent_coreai import families
from recurrent_coreai.checkpoints import reader
from recurrent_coreai.coreai.convert import state_writes
from recurrent_coreai.coreai.entrypoints import ENTRY_POINTS

STEPS = 64
CHUNK = 16


@pytest.fixture(scope="module", params=families.available())
def fam(request):
    torch.set_num_threads(1)
    family = families.get(request.param)
    geom = family.geometry_from_shape(family.tiny_shape, "test")
    weights = dict(family.synthetic_tensors(geom, 7))
    return family, geom, weights


@pytest.mark.parametrize("name", families.available())
def test_every_family_states_a_tiny_shape_of_its_own_keys(name):
    family = families.get(name)
    shape = getattr(family, "tiny_shape", None)
    assert isinstance(shape, dict) and shape, \
        f"family {name} has no tiny_shape (set it in families/{name}/__init__.py: the smallest source.shape)"
    family.geometry_from_shape(shape, "tiny_shape")  # a shape config.yaml could hold


def test_synthetic_weights_are_deterministic_and_in_the_normal_form(fam):
    family, geom, weights = fam
    again = dict(family.synthetic_tensors(geom, 7))
    assert list(weights) == list(family.normal_shapes(geom))
    assert all(tuple(weights[n].shape) == s for n, s in family.normal_shapes(geom).items())
    assert all(torch.equal(weights[n], again[n]) for n in weights)
    other = dict(family.synthetic_tensors(geom, 8))
    assert any(not torch.equal(weights[n], other[n]) for n in weights if weights[n].numel() > 1)
    assert family.parameter_count(geom) > 0
    assert family.geometry_from_dict(geom.as_dict()) == geom


@pytest.mark.parametrize("layout_index", range(max(len(families.get(n).layouts) for n in families.available())))
def test_every_layout_normalises_to_the_normal_form(fam, layout_index, tmp_path):
    """Every layout the family accepts, its tiny model written in it (a layout outside
    ``synthetic_layouts`` that needs another geometry, e.g. Gated DeltaNet's fla-tied for an
    untied shape, is skipped, saying so: the family's own tests cover it)."""
    family, geom, weights = fam
    if layout_index >= len(family.layouts):
        pytest.skip(f"{family.name} has {len(family.layouts)} layouts")
    layout = family.layouts[layout_index]
    try:
        path = family.write_layout(weights, tmp_path, layout, geom)
    except ValueError as exc:
        if layout in family.synthetic_layouts:
            raise
        pytest.skip(f"{family.name} writes its {layout} layout only from another geometry than its tiny_shape ({exc})")
    src = tmp_path if (tmp_path / "config.json").exists() else path
    ck = reader.read_checkpoint(src, family)
    assert ck.layout == layout
    assert ck.geometry == geom
    assert list(ck.tensors) == list(weights)
    assert all(torch.equal(ck.tensors[n].to(weights[n].dtype), weights[n]) for n in weights), layout


@torch.no_grad()
def _logits(module, ids):
    x = torch.tensor([ids], dtype=torch.int32)
    return module(x, torch.zeros_like(x)).reshape(-1).double()


def test_decode_equals_the_reference_and_prefill_equals_decode_steps(fam):
    family, geom, weights = fam
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, min(geom.vocab, 256), (STEPS,), generator=gen).tolist()
    ref = family.reference(weights, geom, torch.float64)
    state = ref.zero_state()
    decode = family.build_decode(weights, geom, torch.float32)
    worst = 0.0
    for t in tokens:
        want = ref.step(t, state).double()
        got = _logits(decode, [t])
        worst = max(worst, float((want - got).abs().max()))
    assert worst < 2e-3, f"{family.name}: decode vs reference over {STEPS} steps: max|dlogits| {worst:.3g}"
    want_states = ref.bundle_states(state)
    specs = family.state_specs(geom)
    assert [s.name for s in specs] == list(want_states)
    for s in specs:
        buf = getattr(decode, s.name)
        assert tuple(buf.shape) == s.shape == want_states[s.name].shape
        assert np.abs(buf.detach().double().numpy() - want_states[s.name]).max() < 2e-3

    # one prefill chunk from the states above == CHUNK decode steps from them
    more = torch.randint(1, min(geom.vocab, 256), (CHUNK,), generator=gen).tolist()
    saved = {s.name: getattr(decode, s.name).clone() for s in specs}
    for t in more:
        step_logits = _logits(decode, [t])
    after_steps = {s.name: getattr(decode, s.name).clone() for s in specs}
    with torch.no_grad():
        for s in specs:
            getattr(decode, s.name).copy_(saved[s.name])
    prefill = family.build_prefill(decode, CHUNK)
    chunk_logits = _logits(prefill, more)
    assert float((chunk_logits - step_logits).abs().max()) < 1e-3
    for s in specs:
        assert float((getattr(decode, s.name) - after_steps[s.name]).abs().max()) < 1e-3, s.name


def test_each_state_is_written_once_per_call_in_every_function(fam):
    family, geom, weights = fam
    decode = family.build_decode(weights, geom, torch.float32)
    states = tuple(s.name for s in family.state_specs(geom))
    for entry in ENTRY_POINTS:
        ep = torch.export.export(entry.module(family, decode, CHUNK), entry.example_inputs(CHUNK))
        assert state_writes(ep, states) == {name: 1 for name in states}, entry.name


def test_the_decode_skeleton_lists_the_linears_and_every_role_is_a_pattern(fam):
    import re

    family, geom, _ = fam
    skeleton = family.decode_skeleton(geom, torch.float16)
    linears = [n for n, m in skeleton.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears
    assert set(family.roles) <= set(__import__("recurrent_coreai.families.base", fromlist=["ROLES"]).ROLES)
    for role, pattern in family.roles.items():
        re.compile(pattern)
    assert any(re.fullmatch(family.roles["lm_head"], n) for n in linears)
