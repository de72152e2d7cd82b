"""State files (coreai/state_file.py, ``generate --save-state/--load-state``) on the session's built
tree: for every family, saving after a prompt and resuming in a fresh session continues exactly as
the uninterrupted run (greedy tokens identical; logits bit for bit when the split falls on a
prefill chunk, else within a few units in the last place of the logits' dtype); the CLI saves after
the prompt and after the text; a state that does not fit the bundle is refused in one line."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from recurrent_coreai import families
from recurrent_coreai.coreai import state_file
from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.tools import generate as gen
from recurrent_coreai.util.errors import PipelineError

RESULTS = None  # the tiny results tree (conftest)
ROOT = Path(__file__).resolve().parents[1]
CFG = cfgmod.load(ROOT / "config.yaml")
TINY = {m: cfgmod.model(CFG, m) for m in cfgmod.models_to_build(CFG)}  # one model per family
M = "rwkv7-tiny"
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 12
QUESTION = "What is 17 times 23?"
STEPS = 12
ULPS = 8  # "within the recipe's rounding": |dlogits| <= ULPS units in the last place at the logits' magnitude


def opened(model: str, recipe: str, use_prefill: bool = True):
    cfg = TINY[model]
    return gen.open_bundle(RESULTS, model, recipe, use_prefill, families.tokenizer_of(cfg), family=cfg["family"])


def greedy(session, logits, steps=STEPS):
    """Greedy tokens and the logits each was chosen from."""
    tokens, rows = [], []
    for _ in range(steps):
        tok = int(np.argmax(logits))
        tokens.append(tok)
        rows.append(logits)
        logits = session.step(tok)
    return tokens, np.array(rows)


def one_per_family() -> list[str]:
    """A model of each family in the build, a trained fixture before a random one (rwkv7-trained's
    256-id head: its runtime calls cost a seventh of rwkv7-tiny's 65536-id ones)."""
    chosen: dict[str, str] = {}
    for m in sorted(TINY, key=lambda m: (TINY[m]["source"]["kind"] != "path", m)):
        chosen.setdefault(TINY[m]["family"], m)
    return sorted(chosen.values())


TRAINED = "rwkv7-trained"
RESUME = [(m, TINY[m]["recipes"][0]) for m in one_per_family()] + [(TRAINED, "fp16")]  # every family; a 16-bit recipe


@pytest.mark.parametrize("model,recipe", RESUME, ids=[f"{m}-{r}" for m, r in RESUME])
def test_resume_equals_the_uninterrupted_run(model, recipe, tmp_path):
    """Save after a system prompt, load the file into a session reset to zero states, feed the
    question: the continuation is the uninterrupted run's (split on a chunk: the same calls, bit
    for bit). (A new session starts from zero states too: reset() is what its constructor does.)"""
    session, tok = opened(model, recipe)
    dtype = np.dtype(session.contract["functions"]["main"]["outputs"][0]["dtype"])
    tail = gen.continuation_tokens(tok, QUESTION, chat=True)
    with session:
        for n in (session.chunk, session.chunk - 14):  # on a prefill chunk, and inside one
            head = tok.prompt(SYSTEM, chat=False)[:n]
            assert len(head) == n
            session.reset()
            whole, whole_logits = greedy(session, session.feed(head + tail))
            session.reset()
            session.feed(head)
            gen.save_state(session, tmp_path / f"{n}.state", len(head))
            session.reset()
            assert gen.load_state(session, tmp_path / f"{n}.state") == n
            resumed, resumed_logits = greedy(session, session.feed(tail))
            assert resumed == whole, (model, n)
            if n == session.chunk:
                np.testing.assert_array_equal(resumed_logits, whole_logits)
            else:
                ulp = float(np.spacing(dtype.type(np.abs(whole_logits).max())))
                assert np.abs(resumed_logits - whole_logits).max() <= ULPS * ulp, (model, n)


def test_a_fresh_session_without_the_state_is_another_run(tmp_path):
    """The check above can fail: the question without the loaded state continues differently."""
    recipe = TINY[M]["recipes"][0]
    session, tok = opened(M, recipe)
    with session:
        head = tok.prompt(SYSTEM, chat=False)[:session.chunk]
        tail = gen.continuation_tokens(tok, QUESTION, chat=True)
        _, whole = greedy(session, session.feed(head + tail))
        session.reset()
        _, cold = greedy(session, session.feed(tail))
    assert np.abs(cold - whole).max() > 1.0


def run_cli(capfd, *args):
    rc = gen.main(["--config-file", str(RESULTS.parent / "config.yaml"), *args])
    out, err = capfd.readouterr()
    return rc, out, err


def test_cli_saves_after_the_prompt_and_resumes(capfd, tmp_path):
    state = tmp_path / "system.state"
    rc, _, err = run_cli(capfd, "--model", M, "--recipe", "fp32", "--no-chat", "--max-new-tokens", "1",
                         "--save-state", str(state), SYSTEM)
    assert rc == 0, err
    meta, arrays = state_file.read(state)
    session, tok = opened(M, "fp32")
    system = tok.prompt(SYSTEM, chat=False)
    assert meta["tokens"] == str(len(system)) and meta["model"] == M and meta["recipe"] == "fp32"
    assert meta["bundle_sha256"] == json.loads((RESULTS / M / "gate" / "fp32.json").read_text())["bundle_sha256"]
    assert sorted(arrays) == sorted(session.state_shapes)
    assert f"state: {len(system)} tokens saved to {state}" in err
    rc, out, err = run_cli(capfd, "--model", M, "--recipe", "fp32", "--max-new-tokens", "10", "--load-state",
                           str(state), QUESTION)
    assert rc == 0, err
    with session:  # the same text as the whole conversation fed at once (token ids: no re-tokenising)
        ids = system + gen.continuation_tokens(tok, QUESTION, chat=True)
        res = gen.generate(session, tok, ids, gen.Sampler(gen.Sampling()), 10, list(gen.DEFAULT_STOP))
    assert out == res.text + "\n"
    assert f"prompt: {len(ids) - len(system)} tokens" in err  # only the question was fed


def test_cli_saves_after_the_generated_text(capfd, tmp_path):
    """--save-at end: the state holds the prompt and every generated token (the last one too)."""
    state = tmp_path / "end.state"
    rc, first, err = run_cli(capfd, "--model", M, "--recipe", "fp32", "--no-chat", "--max-new-tokens", "5",
                             "--save-state", str(state), "--save-at", "end", "Once upon a time")
    assert rc == 0, err
    session, tok = opened(M, "fp32")
    prompt = tok.prompt("Once upon a time", chat=False)
    assert state_file.read(state)[0]["tokens"] == str(len(prompt) + 5)
    rc, second, err = run_cli(capfd, "--model", M, "--recipe", "fp32", "--no-chat", "--max-new-tokens", "6",
                              "--load-state", str(state), " and then")
    assert rc == 0, err
    with session:
        generated, _ = greedy(session, session.feed(prompt), 5)
        session.step(generated[-1])
        more = gen.continuation_tokens(tok, " and then", chat=False)
        res = gen.generate(session, tok, more, gen.Sampler(gen.Sampling()), 6, [])
    assert second == res.text + "\n"


# --- state files that do not fit: one line each, nothing on stdout, before any text --------------
def _rewrite(src: Path, dst: Path, meta_edit=None, array_edit=None) -> Path:
    meta, arrays = state_file.read(src)
    from safetensors.numpy import save

    if meta_edit:
        meta = meta_edit(dict(meta))
    if array_edit:
        arrays = array_edit(dict(arrays))
    dst.write_bytes(save(arrays, metadata=meta))
    return dst


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A fp32 state of rwkv7-tiny after a short prompt, and one of its fp16 bundle and of gdn-tiny."""
    d = tmp_path_factory.mktemp("states")
    out = {}
    for model, recipe in ((M, "fp32"), (M, "fp16"), ("gdn-tiny", "fp32")):
        session, tok = opened(model, recipe, use_prefill=False)
        with session:
            ids = tok.prompt("Hello", chat=False)
            gen.feed(session, ids)
            out[(model, recipe)] = gen.save_state(session, d / f"{model}-{recipe}.state", len(ids))
    return out


def _bad_cases(saved, tmp: Path):
    good = saved[(M, "fp32")]
    data = good.read_bytes()
    (tmp / "truncated.state").write_bytes(data[:-100])
    (tmp / "garbage.state").write_bytes(b"\x00" * 7)
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header["recState"]["data_offsets"][1] += 4  # a header that claims more bytes than there are
    text = json.dumps(header).encode()
    (tmp / "header.state").write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])
    return [
        (tmp / "missing.state", "no such state file"),
        (tmp / "truncated.state", "is not a complete safetensors state file"),
        (tmp / "garbage.state", "is not a complete safetensors state file"),
        (tmp / "header.state", "is not a complete safetensors state file"),
        (saved[(M, "fp16")], f"holds a state of {M}/fp16, not of {M}/fp32"),
        (saved[("gdn-tiny", "fp32")], f"holds a state of gdn-tiny/fp32, not of {M}/fp32"),
        (_rewrite(good, tmp / "format.state", lambda m: {**m, "format": "other/9"}), "is not a state file of this format"),
        (_rewrite(good, tmp / "bundle.state", lambda m: {**m, "bundle_sha256": "0" * 64}), "was saved from another bundle"),
        (_rewrite(good, tmp / "tok.state", lambda m: {**m, "tokenizer_sha256": "0" * 64}), "was saved with another tokenizer"),
        (_rewrite(good, tmp / "tokens.state", lambda m: {**m, "tokens": "-3"}), "names '-3' tokens"),
        (_rewrite(good, tmp / "dtype.state", array_edit=lambda a: {**a, "recState": a["recState"].astype(np.float16)}),
         "state recState is float16, the bundle's is float32"),
        (_rewrite(good, tmp / "shape.state", array_edit=lambda a: {**a, "shiftState": a["shiftState"][:1]}),
         "state shiftState has shape [1, 1, 2, 128]"),
        (_rewrite(good, tmp / "names.state", array_edit=lambda a: {"recState": a["recState"]}),
         "holds states ['recState'], the bundle has ['recState', 'shiftState']"),
        (_rewrite(good, tmp / "nan.state", array_edit=lambda a: {**a, "recState": np.full_like(a["recState"], np.nan)}),
         "state recState holds"),
    ]


def test_bad_state_files_are_one_line_each(saved, tmp_path, capfd):
    for path, what in _bad_cases(saved, tmp_path):
        rc, out, err = run_cli(capfd, "--model", M, "--recipe", "fp32", "--max-new-tokens", "3", "--load-state",
                               str(path), QUESTION)
        assert (rc, out) == (1, ""), (path.name, rc, out, err)
        assert err.count("\n") == 1 and err.startswith(f"error: {path}: ") and what in err and " -- fix: " in err, \
            (path.name, err)


def test_the_good_state_loads(saved, capfd):
    """(The cases above are refused for what they break: the file they were made from loads.)"""
    rc, out, err = run_cli(capfd, "--model", M, "--recipe", "fp32", "--max-new-tokens", "3", "--load-state",
                           str(saved[(M, "fp32")]), QUESTION)
    assert rc == 0 and out.strip(), err


def test_a_refused_state_leaves_the_session_unchanged(saved, tmp_path):
    session, tok = opened(M, "fp32", use_prefill=False)
    with session:
        gen.feed(session, tok.prompt("Hi", chat=False))
        before = session.state_arrays()
        with pytest.raises(PipelineError):
            gen.load_state(session, saved[(M, "fp16")])
        after = session.state_arrays()
    assert all(np.array_equal(before[n], after[n]) for n in before)


def test_save_state_refuses_a_missing_directory(capfd, tmp_path):
    rc, out, err = run_cli(capfd, "--model", M, "--recipe", "fp32", "--save-state", str(tmp_path / "no" / "s.state"),
                           QUESTION)
    assert (rc, out) == (1, "") and err == (f"error: {tmp_path / 'no' / 's.state'}: its directory does not exist -- fix: "
                                            "create it, or save the state elsewhere\n")
