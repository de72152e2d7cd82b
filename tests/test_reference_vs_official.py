"""Our pure-PyTorch Reference against BlinkDL's own RWKV_x070 (PyPI ``rwkv`` 0.8.32).

The official side runs in a subprocess: ``rwkv.model`` reads RWKV_* environment variables at
import, scripts its functions with torch.jit and flips global torch backend flags, none of which
should leak into the pytest process. Our synthetic fla-layout weights go through
``blinkdl.from_hf`` into a ``.pth`` that the official loader reads by path without the extension.

Checked per shape: max|Δlogits| <= 1e-4 (fp32) with identical argmax at every step, and the
recurrent state after the sequence (BlinkDL keeps the wkv state as [H, V, K], ours is fla's
[H, K, V]; its att/ffn shift states are the ln1/ln2 outputs of the last token). Mutants of the
reference (one sign flipped, one eps changed) must be reported by the same comparison.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from recurrent_coreai.families.rwkv7 import blinkdl
from recurrent_coreai.families.rwkv7 import reference
from recurrent_coreai.pipeline.config import load as load_config
from recurrent_coreai.families.rwkv7.geometry import Geometry
from recurrent_coreai.families.rwkv7.reference import Reference, State
from recurrent_coreai.families.rwkv7.synthetic import pack_mixers, synthetic_state_dict
from recurrent_coreai.tokenizers.trie import TrieTokenizer
from recurrent_coreai.tokenizers.world import package_vocab, parse_world_vocab

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[1]
LOGIT_TOL = 1e-4   # max |Δlogits|, fp32 vs fp32
STATE_TOL = 1e-4   # max |Δ| of every state tensor after the sequence
SEED = 20261129
N_TOKENS = 72      # >= 64

SHAPES = {
    "tiny": Geometry(layers=2, hidden=128, head_dim=64, ffn=512, vocab=65536,
                     decay_lora=16, a_lora=16, v_lora=16, gate_lora=32),
    "wide": Geometry(layers=3, hidden=256, head_dim=64, ffn=1024, vocab=65536,
                     decay_lora=32, a_lora=24, v_lora=16, gate_lora=48),
}

# Runs in a fresh interpreter: argv = model path without .pth, token json, output .pt
OFFICIAL_WORKER = r"""
import json, os, sys
os.environ["RWKV_V7_ON"] = "1"
os.environ["RWKV_JIT_ON"] = "1"
os.environ["RWKV_CUDA_ON"] = "0"
import torch
torch.set_num_threads(1)
from rwkv.model import RWKV
model = RWKV(model=sys.argv[1], strategy="cpu fp32")
tokens = json.loads(open(sys.argv[2]).read())
state, logits = None, []
for t in tokens:
    out, state = model.forward([t], state)
    logits.append(out.detach().clone())
state = [s.detach().clone() for s in state]
# the official sequence path (RWKV_x070_TMix_seq) on a fresh state, all positions
seq_logits, seq_state = model.forward(list(tokens), None, full_output=True)
torch.save({"type": type(model).__name__, "logits": torch.stack(logits), "state": state,
            "seq_logits": seq_logits.detach().clone(), "seq_state": [s.detach().clone() for s in seq_state]},
           sys.argv[3])
"""


# --- helpers -----------------------------------------------------------------------------------
def world_tokenizer() -> TrieTokenizer:
    v = load_config(REPO / "config.yaml")["vocab"]
    return TrieTokenizer(parse_world_vocab(package_vocab(v["package"], v["version"], v["file"], v["sha256"])))


def token_sequence(vocab: int, n: int = N_TOKENS) -> list[int]:
    """Token 0, a World-encoded chat prompt, then varied ids (bytes, extremes, pseudo-random)."""
    tok = world_tokenizer()
    assert tok.encode("User: hi\n\nAssistant:") == [24281, 59, 4571, 261, 5585, 41693, 59]  # the World vocab
    chat = tok.encode("User: Write a haiku about the sea, please.\n\nAssistant:")
    gen = torch.Generator().manual_seed(7)
    varied = [1, 255, 256, 261, vocab - 1, 65529 % vocab, 0, 10]
    varied += torch.randint(1, vocab, (n,), generator=gen).tolist()
    return ([0] + chat + varied)[:n]


def run_official(sd_hf: dict, tokens: list[int], tmp: Path) -> dict:
    torch.save(blinkdl.from_hf(sd_hf), tmp / "model.pth")
    (tmp / "tokens.json").write_text(json.dumps(tokens))
    (tmp / "worker.py").write_text(OFFICIAL_WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RWKV_")}
    proc = subprocess.run([sys.executable, str(tmp / "worker.py"), str(tmp / "model"), str(tmp / "tokens.json"),
                           str(tmp / "official.pt")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"official rwkv worker failed:\n{proc.stdout}\n{proc.stderr}"
    out = torch.load(tmp / "official.pt", weights_only=True)
    assert out["type"] == "RWKV_x070", out["type"]
    return out


def official_state_as_ours(flat: list[torch.Tensor], g: Geometry) -> State:
    """BlinkDL's state list [att_x_prev (C), att_kv [H,V,K], ffn_x_prev (C)] * L -> our State."""
    assert len(flat) == 3 * g.layers
    return State(att_shift=torch.stack([flat[3 * i + 0] for i in range(g.layers)]),
                 ffn_shift=torch.stack([flat[3 * i + 2] for i in range(g.layers)]),
                 wkv=torch.stack([flat[3 * i + 1].transpose(-1, -2) for i in range(g.layers)]))


@dataclass
class Comparison:
    max_dlogit: float
    argmax_mismatch: list[int]
    state_diff: dict[str, float]

    def violations(self, logit_tol: float = LOGIT_TOL, state_tol: float = STATE_TOL) -> list[str]:
        out = []
        if not self.max_dlogit <= logit_tol:  # also catches NaN
            out.append(f"max|Δlogits| {self.max_dlogit:.3g} > {logit_tol:g}")
        if self.argmax_mismatch:
            out.append(f"argmax differs at steps {self.argmax_mismatch[:10]}")
        for name, d in self.state_diff.items():
            if not d <= state_tol:
                out.append(f"state {name} max|Δ| {d:.3g} > {state_tol:g}")
        return out


def compare(ours_logits, ours_state: State, off_logits, off_state: State) -> Comparison:
    assert ours_logits.shape == off_logits.shape, (ours_logits.shape, off_logits.shape)
    d = (ours_logits.double() - off_logits.double()).abs().max().item()
    mism = torch.nonzero(ours_logits.argmax(-1) != off_logits.argmax(-1)).flatten().tolist()
    sd = {}
    for name in ("wkv", "att_shift", "ffn_shift"):
        a, b = getattr(ours_state, name), getattr(off_state, name)
        assert a.shape == b.shape, (name, a.shape, b.shape)
        sd[name] = (a.double() - b.double()).abs().max().item()
    return Comparison(d, mism, sd)


def mutant(old: str, new: str) -> type[Reference]:
    """A copy of Reference.advance (every layer of a step) with exactly one textual change, as a
    Reference subclass."""
    src = textwrap.dedent(inspect.getsource(Reference.advance))
    assert src.count(old) == 1, f"mutation anchor {old!r} not found exactly once in Reference.advance"
    ns: dict = {}
    exec(compile(src.replace(old, new), "<mutant Reference.advance>", "exec"), dict(vars(reference)), ns)
    return type("MutantReference", (Reference,), {"advance": ns["advance"]})


# --- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def get_case(tmp_path_factory):
    cache: dict[str, dict] = {}

    def build(name: str) -> dict:
        if name not in cache:
            g = SHAPES[name]
            sd = synthetic_state_dict(g, SEED)
            tokens = token_sequence(g.vocab)
            official = run_official(sd, tokens, tmp_path_factory.mktemp(f"official-{name}"))
            ours_logits, ours_state = Reference(sd, g, torch.float32).run(tokens)
            cache[name] = {"name": name, "g": g, "sd": sd, "tokens": tokens,
                           "off_logits": official["logits"],
                           "off_state": official_state_as_ours(official["state"], g),
                           "seq_logits": official["seq_logits"],
                           "seq_state": official_state_as_ours(official["seq_state"], g),
                           "ours_logits": ours_logits, "ours_state": ours_state}
        return cache[name]

    return build


@pytest.fixture(params=sorted(SHAPES))
def case(request, get_case):
    return get_case(request.param)


@pytest.fixture
def tiny(get_case):
    return get_case("tiny")


# --- tests -------------------------------------------------------------------------------------
def test_reference_matches_official(case):
    tokens = case["tokens"]
    assert len(tokens) >= 64 and tokens[0] == 0
    assert case["off_logits"].shape == (len(tokens), case["g"].vocab)
    res = compare(case["ours_logits"], case["ours_state"], case["off_logits"], case["off_state"])
    print(f"[{case['name']}] max|Δlogits| {res.max_dlogit:.3g}; state max|Δ| "
          + ", ".join(f"{k} {v:.3g}" for k, v in res.state_diff.items()))
    assert res.violations() == []


def test_reference_matches_official_sequence_path(case):
    """BlinkDL's whole-sequence entry point (forward_seq, full_output) gives the same answer."""
    assert case["seq_logits"].shape == case["off_logits"].shape
    res = compare(case["ours_logits"], case["ours_state"], case["seq_logits"], case["seq_state"])
    assert res.violations() == []


def test_states_are_not_trivially_equal(case):
    """The state comparison only means something if the states are big and the orientation
    matters: the transpose of the official wkv state must NOT match ours."""
    ours, off = case["ours_state"], case["off_state"]
    assert ours.wkv.abs().max() > 0.1 and ours.att_shift.abs().max() > 0.1 and ours.ffn_shift.abs().max() > 0.1
    wrong = State(off.att_shift, off.ffn_shift, off.wkv.transpose(-1, -2))
    res = compare(case["ours_logits"], ours, case["off_logits"], wrong)
    assert any(v.startswith("state wkv") for v in res.violations())


def test_fp64_reference_also_within_tolerance(case):
    """Our fp64 oracle against the fp32 official run: the fp32 gap is rounding, not math."""
    logits64, state64 = Reference(case["sd"], case["g"], torch.float64).run(case["tokens"])
    res = compare(logits64, state64, case["off_logits"], case["off_state"])
    assert res.violations() == []


def test_reference_accepts_packed_mixers(case):
    """Same logits whether the reference is given split or packed (attn.x_x) mixers."""
    tokens = case["tokens"][:8]
    a, _ = Reference(case["sd"], case["g"]).run(tokens)
    b, _ = Reference(pack_mixers(case["sd"]), case["g"]).run(tokens)
    assert torch.equal(a, b)


MUTATIONS = {
    # decay exp(+exp(-0.5)·σ) > 1 instead of < 1
    "decay sign": ("logw = -torch.exp(torch.tensor(-0.5", "logw = +torch.exp(torch.tensor(-0.5"),
    # the removal term of the delta rule added instead of subtracted
    "kk term sign": ("S - torch.outer(kka,", "S + torch.outer(kka,"),
    # GroupNorm eps 1e-5 instead of BlinkDL's 64e-5 (a subtle one; geometry.G_NORM_EPS)
    "g_norm eps": ("eps=g.g_norm_eps", "eps=g.norm_eps"),
    # the r·k·r_k bonus term left out
    "bonus dropped": ("o = o + bonus.reshape(-1)", "o = o + 0 * bonus.reshape(-1)"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_comparison_catches_broken_math(tiny, mutation):
    case = tiny
    cls = mutant(*MUTATIONS[mutation])
    logits, state = cls(case["sd"], case["g"], torch.float32).run(case["tokens"])
    res = compare(logits, state, case["off_logits"], case["off_state"])
    assert res.violations(), f"mutant {mutation!r} passed the comparison (max|Δlogits| {res.max_dlogit:.3g})"


def test_unmutated_copy_passes(tiny):
    """The mutant machinery itself (copy + exec of Reference.advance) changes nothing."""
    case = tiny
    cls = mutant("o = o + bonus.reshape(-1)", "o = o + bonus.reshape(-1)")
    logits, state = cls(case["sd"], case["g"], torch.float32).run(case["tokens"])
    assert torch.equal(logits, case["ours_logits"])
    assert torch.equal(state.wkv, case["ours_state"].wkv)


# --- blinkdl converters ------------------------------------------------------------------------
def test_blinkdl_round_trip_exact(case):
    g, sd = case["g"], case["sd"]
    bd = blinkdl.from_hf(sd)
    assert blinkdl.is_blinkdl(bd.keys())
    assert not any(k.startswith("model.") for k in bd)
    assert "blocks.0.att.v0" not in bd and "blocks.1.att.v0" in bd
    assert bd["blocks.0.att.w1"].shape == (g.hidden, g.decay_lora)    # BlinkDL: [C, D]
    assert bd["blocks.0.att.w2"].shape == (g.decay_lora, g.hidden)    # BlinkDL: [D, C]
    assert bd["blocks.0.att.w0"].shape == (1, 1, g.hidden)
    back = blinkdl.to_hf(bd)
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert back[k].dtype == v.dtype, k
        assert back[k].shape == v.shape, k
        assert torch.equal(back[k], v), k
    again = blinkdl.from_hf(back)
    assert set(again) == set(bd)
    for k, v in bd.items():
        assert again[k].shape == v.shape and torch.equal(again[k], v), k
