"""The chunked WKV7 form (recurrent_coreai.families.rwkv7.chunked) and the ``prefill`` entry point.

Two levels, each against an independent path:
* WKV: ``chunked.wkv_chunk`` vs a per-token recurrence written here (fp64 oracle), chunks 1/16/64;
* model (eager torch): ``prefill`` chunks + ``main`` for the tail vs ``main`` token by token (the
  same graph) and vs ``Reference`` token by token, prompts 1, T-1, T, T+1, 3T+5 for T = 1, 16, 64.

The Core AI level (both functions in ONE bundle, prefill-then-decode in the runtime vs the
reference, states after each chunk, bundle size with and without prefill) is the gate's prefill
check: tests/test_prefill_gate.py and tests/test_gate_breaks.py (which reuses the mutations here).
Deliberate breaks (wrong cumsum offset, missing in-chunk terms, a state written twice) must be
caught by the same comparisons.

Tolerances (measured on this machine; tiny default model, 197-token stream; random WKV inputs with
|o| ~ 10, |S| ~ 10):
* fp64: chunk vs recurrence ≤ 1e-10 (measured ≤ 7.3e-14); prefill vs main graph and vs the fp64
  Reference ≤ 1e-10 on logits and states (measured ≤ 2.9e-14 and ≤ 1.0e-13).
* fp32: WKV chunk vs fp64 recurrence: o ≤ 1.5e-4, S ≤ 3e-5 (measured 5.9e-5 / 1.0e-5 at T = 64; the
  fp32 recurrence itself is ~1.9e-5 / 1.6e-6 off). Model: prefill vs fp64 Reference ≤ 5e-5 on
  logits, ≤ 1e-5 on states (measured 1.2e-5 / 2.9e-6; the fp32 main graph alone: 7.0e-6 / 2.6e-6);
  the Core AI runtime: 1.4e-5 / 2.6e-6.
"""

from __future__ import annotations

import inspect
import math
import textwrap

import pytest
import torch

from recurrent_coreai.families.rwkv7 import chunked
from recurrent_coreai.coreai import convert
from recurrent_coreai.families.rwkv7 import export_graph
from recurrent_coreai.checkpoints.reader import load_checkpoint
from recurrent_coreai.coreai.entrypoints import by_role, split_prompt
from recurrent_coreai.families.rwkv7.export_graph import build_decode, build_prefill
from recurrent_coreai.families.rwkv7.reference import Reference, State

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNKS = (1, 16, 64)
WKV_TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (1.5e-4, 3e-5)}    # (o, S)
MODEL_TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (5e-5, 1e-5)}    # (logits, states) vs fp64 Reference
SAME_GRAPH_TOL_FP64 = 1e-10


def prompt_lengths(T: int) -> list[int]:
    return sorted({n for n in (1, T - 1, T, T + 1, 3 * T + 5) if n >= 1})


# ------------------------------------------------------------------------------------------------
# WKV level
# ------------------------------------------------------------------------------------------------
def recurrence(r, k, v, kk, a, logw, S):
    """The oracle: token by token, per head, exactly the formula (fla orientation, S is K×V)."""
    S = S.clone()
    outs = []
    for t in range(r.shape[1]):
        kka = kk[:, t] * a[:, t]                                                 # [H,K]
        kkS = torch.einsum("hk,hkv->hv", kk[:, t], S)
        S = (torch.exp(logw[:, t])[:, :, None] * S - kka[:, :, None] * kkS[:, None, :]
             + k[:, t][:, :, None] * v[:, t][:, None, :])
        outs.append(torch.einsum("hkv,hk->hv", S, r[:, t]))
    return torch.stack(outs, 1), S


def wkv_inputs(T: int, seed: int = 0, H: int = 3, N: int = 64, strongest_decay: bool = False):
    """fp64 inputs shaped like the model's: |kk| = 1, a in (0,1), log w in (-e^-0.5, 0)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda: torch.randn(H, T, N, generator=g, dtype=torch.float64)  # noqa: E731
    r, k, v, kk = rnd(), rnd(), rnd(), rnd()
    kk = kk / kk.norm(dim=-1, keepdim=True)
    a = torch.rand(H, T, N, generator=g, dtype=torch.float64)
    logw = -math.exp(-0.5) * torch.sigmoid(3 * rnd())
    if strongest_decay:
        logw = torch.full_like(logw, -math.exp(-0.5))
    S = torch.randn(H, N, N, generator=g, dtype=torch.float64)
    return r, k, v, kk, a, logw, S


def wkv_errors(T: int, dtype, fn=None, **kw) -> tuple[float, float]:
    inputs = wkv_inputs(T, **kw)
    o_ref, S_ref = recurrence(*inputs)
    o, S = (fn or chunked.wkv_chunk)(*(t.to(dtype) for t in inputs))
    return (o.double() - o_ref).abs().max().item(), (S.double() - S_ref).abs().max().item()


@pytest.mark.parametrize("strongest_decay", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("T", CHUNKS)
def test_wkv_chunk_matches_recurrence(T, dtype, strongest_decay):
    err_o, err_S = wkv_errors(T, dtype, strongest_decay=strongest_decay)
    tol_o, tol_S = WKV_TOL[dtype]
    assert err_o <= tol_o and err_S <= tol_S, (err_o, err_S)


def test_wkv_chunk_is_not_trivially_close():
    """The inputs move the state: a chunk that ignored the tokens would be far off."""
    r, k, v, kk, a, logw, S = wkv_inputs(16)
    o_ref, S_ref = recurrence(r, k, v, kk, a, logw, S)
    assert (S_ref - S).abs().max() > 1.0 and (o_ref - torch.einsum("hkv,htk->htv", S, r)).abs().max() > 1.0


@pytest.mark.parametrize("T", [1, 2, 16, 37, 64, 128])
def test_unit_lower_inverse_is_exact(T):
    g = torch.Generator().manual_seed(T)
    L = -torch.rand(2, T, T, generator=g, dtype=torch.float64).tril(-1)
    eye = torch.eye(T, dtype=torch.float64)
    exact = torch.linalg.solve_triangular(eye - L, eye.expand(2, T, T), upper=False)
    assert (chunked.unit_lower_inverse(L) - exact).abs().max().item() <= 1e-10 * max(1.0, exact.abs().max().item())


def test_fp16_chunk_needs_fp32_inside():
    """Why the chunk runs in fp32 inside an fp16 graph: in fp16 the decay factors overflow
    (inf, then NaN from inf·0 in the causal mask: from chunk 32 with these inputs, from 16 with the
    strongest decay); fp16 in and out with the chunk in fp32 stays finite and within fp16 rounding
    of the fp64 recurrence (measured 0.036 on o, 0.0065 on S at T = 64)."""
    for T, strongest in ((32, False), (64, False), (16, True)):
        inputs = [t.half() for t in wkv_inputs(T, strongest_decay=strongest)]
        o, S = chunked.wkv_chunk(*inputs, compute_dtype=torch.float16)
        assert not (torch.isfinite(o).all() and torch.isfinite(S).all()), (T, strongest)
    inputs = wkv_inputs(64)
    o_ref, S_ref = recurrence(*inputs)
    o, S = chunked.wkv_chunk(*(t.half() for t in inputs))
    assert o.dtype == S.dtype == torch.float16
    assert (o.double() - o_ref).abs().max() <= 0.1 and (S.double() - S_ref).abs().max() <= 0.02


def test_prefill_chunk_bound():
    from recurrent_coreai.families.rwkv7.geometry import Geometry

    g = Geometry(layers=1, hidden=64, head_dim=64, ffn=64, vocab=8, decay_lora=4, a_lora=4, v_lora=4, gate_lora=4)
    decode = export_graph.RWKV7Decode(g)
    assert build_prefill(decode, chunked.MAX_CHUNK).chunk == chunked.MAX_CHUNK
    for bad in (0, chunked.MAX_CHUNK + 1):
        with pytest.raises(ValueError, match="1..128"):
            build_prefill(decode, bad)


# ------------------------------------------------------------------------------------------------
# model level, eager torch
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_source):
    g, weights = load_checkpoint(tiny_source)
    n = 3 * max(CHUNKS) + 5
    tokens = [0] + torch.randint(1, g.vocab, (n - 1,), generator=torch.Generator().manual_seed(5)).tolist()
    return {"g": g, "weights": weights, "tokens": tokens,
            "lengths": sorted({n for T in CHUNKS for n in prompt_lengths(T)})}


def snapshot(state: State) -> State:
    return State(state.att_shift.clone(), state.ffn_shift.clone(), state.wkv.clone())


def graph_state(module) -> State:
    return State(module.shiftState[:, 0, 0].clone(), module.shiftState[:, 0, 1].clone(), module.recState[:, 0].clone())


def ids(tokens) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(tokens)
    return torch.tensor([tokens], dtype=torch.int32), torch.arange(n, dtype=torch.int32).reshape(1, n)


@pytest.fixture(scope="module")
def decoders(tiny):
    return {dt: build_decode(tiny["weights"], tiny["g"], dt) for dt in (torch.float64, torch.float32)}


@pytest.fixture(scope="module")
def token_by_token(tiny, decoders):
    """{path: {n: (last logits, state after n tokens)}} for the fp64 reference and the fp64 main graph."""
    ref = Reference(tiny["weights"], tiny["g"], torch.float64)
    state, snaps = ref.zero_state(), {}
    for n, tok in enumerate(tiny["tokens"], 1):
        logits = ref.step(tok, state)
        if n in tiny["lengths"]:
            snaps[n] = (logits.clone(), snapshot(state))
    out = {"ref": snaps, "reference": ref}
    decode, snaps = decoders[torch.float64], {}
    decode.reset()
    with torch.no_grad():
        for n, tok in enumerate(tiny["tokens"], 1):
            logits = decode(*ids([tok]))
            if n in tiny["lengths"]:
                snaps[n] = (logits[0, 0].clone(), graph_state(decode))
    out["main"] = snaps
    return out


def run_prefill(decoders, tokens, dtype, T: int, n: int) -> tuple[torch.Tensor, State]:
    """The first n tokens from zero states: full chunks through prefill, the tail through main
    (no padding)."""
    decode = decoders[dtype]
    decode.reset()
    prefill = build_prefill(decode, T)
    full, _ = split_prompt(n, T)
    with torch.no_grad():
        for c in range(full):
            logits = prefill(*ids(tokens[c * T:(c + 1) * T]))
        for tok in tokens[full * T:n]:
            logits = decode(*ids([tok]))
    return logits[0, 0], graph_state(decode)


def diffs(logits, state: State, ref) -> dict[str, float]:
    ref_logits, ref_state = ref
    out = {"logits": (logits.double() - ref_logits.double()).abs().max().item()}
    for name in ("wkv", "att_shift", "ffn_shift"):
        out[name] = (getattr(state, name).double() - getattr(ref_state, name).double()).abs().max().item()
    return out


def violations(d: dict[str, float], tol_logits: float, tol_state: float) -> list[str]:
    out = [f"{k} max|Δ| {v:.3g} > {tol_logits if k == 'logits' else tol_state:g}" for k, v in d.items()
           if not v <= (tol_logits if k == "logits" else tol_state)]  # NaN fails too
    return out


CASES = [(T, n) for T in CHUNKS for n in prompt_lengths(T)]


@pytest.mark.parametrize("T,n", CASES, ids=[f"T{T}-n{n}" for T, n in CASES])
def test_prefill_fp64_matches_main_and_reference(tiny, decoders, token_by_token, T, n):
    logits, state = run_prefill(decoders, tiny["tokens"], torch.float64, T, n)
    assert violations(diffs(logits, state, token_by_token["main"][n]), SAME_GRAPH_TOL_FP64, SAME_GRAPH_TOL_FP64) == []
    assert violations(diffs(logits, state, token_by_token["ref"][n]), *MODEL_TOL[torch.float64]) == []


@pytest.mark.parametrize("T,n", CASES, ids=[f"T{T}-n{n}" for T, n in CASES])
def test_prefill_fp32_matches_reference(tiny, decoders, token_by_token, T, n):
    logits, state = run_prefill(decoders, tiny["tokens"], torch.float32, T, n)
    d = diffs(logits, state, token_by_token["ref"][n])
    assert violations(d, *MODEL_TOL[torch.float32]) == [], d
    assert torch.argmax(logits) == torch.argmax(token_by_token["ref"][n][0])


def test_states_are_big_enough_to_matter(token_by_token):
    _, state = token_by_token["ref"][3 * max(CHUNKS) + 5]
    assert state.wkv.abs().max() > 1.0 and state.att_shift.abs().max() > 0.1 and state.ffn_shift.abs().max() > 0.1


# --- deliberate breaks: the comparisons above must catch them --------------------------------------
def mutant_wkv_chunk(old: str, new: str):
    src = textwrap.dedent(inspect.getsource(chunked.wkv_chunk))
    assert src.count(old) == 1, f"mutation anchor {old!r} not found exactly once in wkv_chunk"
    ns: dict = {}
    exec(compile(src.replace(old, new), "<mutant wkv_chunk>", "exec"), dict(vars(chunked)), ns)
    return ns["wkv_chunk"]


WKV_MUTATIONS = {
    "decay offset: inclusive cumsum where exclusive is due": ("c_ex = c - logw", "c_ex = c"),
    "decay offset: cumsum shifted to exclusive": ("c = torch.cumsum(logw, dim=-2)",
                                                  "c = torch.cumsum(logw, dim=-2) - logw"),
    "missing in-chunk k v term in U": (" + torch.matmul(L_k, v))", ")"),
    "missing in-chunk delta term in o": ("+ torch.matmul(torch.matmul(r_d, alpha_gT) * incl, U)", ""),
    "u_t reads its own token's k v (diagonal in L_k)": ("L_k = torch.matmul(kk_d, k_gT) * strict",
                                                         "L_k = torch.matmul(kk_d, k_gT) * incl"),
}


@pytest.mark.parametrize("mutation", sorted(WKV_MUTATIONS))
def test_breaks_are_caught(tiny, decoders, token_by_token, monkeypatch, mutation):
    broken = mutant_wkv_chunk(*WKV_MUTATIONS[mutation])
    err_o, err_S = wkv_errors(16, torch.float32, fn=broken)
    assert not (err_o <= WKV_TOL[torch.float32][0] and err_S <= WKV_TOL[torch.float32][1]), mutation
    monkeypatch.setattr(chunked, "wkv_chunk", broken)
    T, n = 16, 3 * 16 + 5
    logits, state = run_prefill(decoders, tiny["tokens"], torch.float32, T, n)
    assert violations(diffs(logits, state, token_by_token["ref"][n]), *MODEL_TOL[torch.float32])


def test_unmutated_copy_passes(tiny, decoders, monkeypatch):
    """The mutation machinery itself does not perturb the result."""
    T, n = 16, 3 * 16 + 5
    expected = run_prefill(decoders, tiny["tokens"], torch.float32, T, n)
    monkeypatch.setattr(chunked, "wkv_chunk", mutant_wkv_chunk("c_ex = c - logw", "c_ex = c - logw"))
    got = run_prefill(decoders, tiny["tokens"], torch.float32, T, n)
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1].wkv, got[1].wkv)


def _prefill_writing_per_layer(self, input_ids, position_ids):
    """The unfused form: recState written once per layer (2 layers -> 2 writes per call)."""
    x = self.model.embeddings(input_ids.reshape(self.chunk).to(torch.int64))
    v_first, shifts = x, []
    for i, block in enumerate(self.model.layers):
        x, att, ffn, S, v_first = block.step(x, self.shiftState[i, :, 0], self.shiftState[i, :, 1], self.recState[i],
                                             v_first)
        self.recState[i].copy_(S)
        shifts.append(torch.stack([att, ffn], dim=1))
    self.shiftState.copy_(torch.stack(shifts))
    return self.lm_head(self.model.norm(x[-1:])).reshape(1, 1, self.g.vocab)


def test_state_written_twice_is_counted(monkeypatch):
    """convert.state_writes counts one write per state for prefill and 2 for recState in the
    unfused mutant. The two exports use the same chunk size in one process: the chunk's mask
    constants are made per trace, so the second trace must not meet tensors of the first (it did
    when the mask tensors were cached)."""
    from recurrent_coreai.families.rwkv7.geometry import Geometry

    g = Geometry(layers=2, hidden=64, head_dim=64, ffn=64, vocab=8, decay_lora=4, a_lora=4, v_lora=4, gate_lora=4)
    T = 8  # a size no other test of this module has made masks for, so the first trace makes them
    counts = []
    for forward in (export_graph.RWKV7Prefill.forward, _prefill_writing_per_layer):
        monkeypatch.setattr(export_graph.RWKV7Prefill, "forward", forward)
        ep = torch.export.export(build_prefill(export_graph.RWKV7Decode(g), T), by_role('prefill').example_inputs(T))
        counts.append(convert.state_writes(ep, export_graph.STATE_NAMES))
    assert counts == [{"recState": 1, "shiftState": 1}, {"recState": 2, "shiftState": 1}]
