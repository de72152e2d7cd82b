"""The text stream's chunked fp32 reference (stages/text_chunked.py; config.yaml reference.chunked)
against the token-by-token reference, per family, and its refusals.

* Every family: the chunked form (the family's fp32 decode and prefill modules, run as the bundle
  runs them) reports the same positions and states as the token-by-token reference and agrees
  within the config's limits (measured ~1e-5 logits, ~5e-7 of a state's scale), on random weights
  and on the trained fixtures through the reference stage's own ``reference_stream``.
* A chunked form that is wrong -- in the logits of a prefill call, or in a state it leaves -- is
  refused by the check against the token-by-token reference, one line, nothing returned.
* ``from_params`` picks the form: at or above it the stream carries the check (``text_check_*``),
  below it the stream is the token-by-token one, byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from recurrent_coreai import families
from recurrent_coreai.stages import reference, text_chunked
from recurrent_coreai.util.errors import PipelineError

ROOT = Path(__file__).resolve().parents[1]
CFG = yaml.safe_load((ROOT / "config.yaml").read_text())
LIMITS = CFG["reference"]["chunked"]
CHUNK, N, HORIZONS = 64, 256, [128, 256]
TINY = {f: m for m, e in CFG["models"].items() if e.get("enabled") and e["source"]["kind"] == "synthetic"
        for f in [e["family"]]}

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(family_name: str):
    """The family's default tiny model's shape with a 256-id head, its synthetic weights."""
    e = CFG["models"][TINY[family_name]]
    fam = families.get(family_name)
    geom = fam.geometry_from_shape({**e["source"]["shape"], "vocab": 256}, TINY[family_name])
    return fam, geom, dict(fam.synthetic_tensors(geom, 1))


def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, N)


def test_every_enabled_family_has_a_tiny_model():
    assert sorted(TINY) == sorted(families.available())


@pytest.mark.parametrize("name", sorted(families.available()))
def test_chunked_form_matches_token_by_token(name):
    fam, geom, w = tiny(name)
    toks = tokens()
    steps = reference.text_stream(fam.reference(w, geom, torch.float32), toks, CHUNK, HORIZONS)
    chunked = text_chunked.chunked_text_stream(fam, w, geom, toks, CHUNK, HORIZONS)
    assert sorted(chunked) == sorted(steps)
    assert (chunked["text_logit_pos"] == steps["text_logit_pos"]).all()
    for key in steps:
        assert chunked[key].shape == steps[key].shape, key
    dl, rel = text_chunked.compare(chunked, steps)
    print(f"\n{name}: chunked vs token by token over {N} tokens: max|dlogits| {dl:.3g}, worst state {rel:.3g}")
    assert dl <= LIMITS["max_abs_dlogits"] / 10 and rel <= LIMITS["max_rel_dstate"] / 10, (dl, rel)


class Broken:
    """A family whose prefill is wrong: ``logit_shift`` added to each prefill call's logits, or
    ``state_scale`` applied to every state buffer after each prefill call."""

    def __init__(self, fam, geom, logit_shift=0.0, state_scale=1.0):
        self.fam, self.logit_shift, self.state_scale = fam, logit_shift, state_scale
        self.state_names = {s.name for s in fam.state_specs(geom)}

    def __getattr__(self, name):
        return getattr(self.fam, name)

    def build_prefill(self, dec, chunk):
        pre, outer = self.fam.build_prefill(dec, chunk), self

        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.pre = pre

            def forward(self, ids, pos):
                out = self.pre(ids, pos) + outer.logit_shift
                for name, buf in dec.named_buffers():
                    if outer.state_scale != 1.0 and name in outer.state_names:
                        buf.mul_(outer.state_scale)
                return out
        return Wrapped()


@pytest.mark.parametrize("what, kw", [("logits", {"logit_shift": 0.01}), ("state", {"state_scale": 1.001})])
def test_a_wrong_chunked_form_is_refused(what, kw):
    fam, geom, w = tiny("rwkv7")
    toks = tokens()
    broken = Broken(fam, geom, **kw)
    first = reference.text_stream(fam.reference(w, geom, torch.float32), toks[:HORIZONS[0]], CHUNK, HORIZONS[:1])
    with pytest.raises(PipelineError, match="disagrees with the token-by-token reference") as err:
        text_chunked.checked(broken, w, geom, toks, CHUNK, HORIZONS, LIMITS, first, "model.pth")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("model.pth") and "reference.chunked.from_params" in msg
    assert ("max|dlogits| 0.01" in msg) == (what == "logits")
    # the same check passes the family's own form
    out = text_chunked.checked(fam, w, geom, toks, CHUNK, HORIZONS, LIMITS, first, "model.pth")
    assert int(out["text_check_tokens"]) == HORIZONS[0] and float(out["text_check_max_dlogits"]) < 1e-4


class Bytes:
    def prompt(self, text, chat=True):
        return list(text.encode())


TRAINED = {"rwkv7": ROOT / "fixtures/trained/rwkv7/model.pth", "mamba1": ROOT / "fixtures/trained/mamba1"}


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_reference_stage_picks_the_form_by_parameter_count(name):
    """The reference stage's own reference_stream on a trained fixture: from_params above its size
    gives the token-by-token stream; 0 gives the chunked one, checked, within the limits of it."""
    fam = families.get(name)
    text = {"file": str(ROOT / CFG["gate"]["text"]["file"]), "tokens": N, "horizons": HORIZONS}
    run = lambda chunked: reference.reference_stream(  # noqa: E731
        fam, TRAINED[name], Bytes(), ["Hi"], 4, str(ROOT / "config.yaml"), {"chunk": CHUNK, "gate_tokens": 133},
        text, chunked)
    steps = run({**LIMITS, "from_params": 10**12})
    none = run(None)
    assert sorted(steps) == sorted(none) and all(np.array_equal(steps[k], none[k]) for k in steps)
    assert not any(k.startswith("text_check_") for k in steps)
    chunked = run({**LIMITS, "from_params": 0})
    assert set(chunked) - set(steps) == set(text_chunked.CHECK_KEYS)
    for key in steps:
        if not key.startswith("text_"):
            assert np.array_equal(chunked[key], steps[key]), key      # prompts and prefill: token by token
    dl, rel = text_chunked.compare(chunked, steps)
    print(f"\n{name} (trained): chunked vs token by token over {N} tokens: max|dlogits| {dl:.3g}, worst state "
          f"{rel:.3g}; the check over {HORIZONS[0]}: {float(chunked['text_check_max_dlogits']):.3g}")
    assert dl <= LIMITS["max_abs_dlogits"] / 10 and rel <= LIMITS["max_rel_dstate"] / 10
