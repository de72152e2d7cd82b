"""`generate`: greedy decoding in the Core AI runtime equals the PyTorch reference's greedy
decoding token for token (fp32 bundle of the session's tiny results tree); seeded sampling
repeats; streamed text never splits a UTF-8 character; stop strings end the text before them;
the prompt goes through ``prefill`` only when export.json lists it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.tools import generate as gen
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.pipeline.records import sealed_text
from recurrent_coreai.tools.sampling import Sampler, Sampling, filtered_probs, penalize
from recurrent_coreai import tokenizers

RESULTS = None  # the tiny results tree (conftest)
M = "rwkv7-tiny"
PROMPT = "Hello, who are you?"
ROOT = Path(__file__).resolve().parents[1]
# what the tiny tree holds: every model config.yaml builds (one per family), with its recipes
TINY = {m: cfgmod.model(cfgmod.load(ROOT / "config.yaml"), m)["recipes"]
        for m in cfgmod.models_to_build(cfgmod.load(ROOT / "config.yaml"))}


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizers.kind("world").load(Layout(RESULTS, M).vocab)


def decode(tokenizer, ids) -> bytes:
    """The bytes of a token sequence (token 0, the end of text, has none)."""
    return b"".join(tokenizer.token_bytes(t) for t in ids)


@pytest.fixture(scope="module")
def fp32_session():
    session, _ = gen.open_bundle(RESULTS, M, "fp32")
    with session:
        yield session


class Scripted:
    """A stand-in for the runtime session that 'predicts' a fixed token sequence (one-hot logits):
    isolates the text handling from the model."""

    function = "main"

    def __init__(self, script: list[int], vocab_size: int = 65536):
        self.script, self.vocab_size, self.i, self.fed = list(script), vocab_size, 0, []

    def _next(self) -> np.ndarray:
        logits = np.zeros(self.vocab_size)
        logits[self.script[min(self.i, len(self.script) - 1)]] = 1.0
        self.i += 1
        return logits

    def feed(self, tokens):
        self.fed += list(tokens)
        return self._next()

    def step(self, token):
        self.fed.append(token)
        return self._next()


def greedy():
    return Sampler(Sampling())


LONG = "Tell me everything you know about " + ", ".join(["the sea", "the mountains", "the rivers", "the forests"] * 6) + "."


@pytest.mark.parametrize("prompt", [PROMPT, LONG], ids=["short-through-main", "long-through-prefill"])
def test_greedy_equals_the_reference_token_for_token(fp32_session, tokenizer, one_thread, prompt):
    from recurrent_coreai.checkpoints.reader import load_checkpoint
    from recurrent_coreai.families.rwkv7.reference import Reference

    ids = gen.chat_tokens(tokenizer, prompt)
    assert ids[0] == 0 and decode(tokenizer, ids) == f"User: {prompt}\n\nAssistant:".encode()
    chunk = fp32_session.chunk
    assert (len(ids) >= chunk) == (prompt == LONG), "LONG must fill a prefill chunk, PROMPT must not"
    n = 24
    fp32_session.reset()
    res = gen.generate(fp32_session, tokenizer, ids, greedy(), n)
    geom, weights = load_checkpoint(Layout(RESULTS, M).source)
    want = Reference(weights, geom, torch.float32).greedy(ids, n, stop=0)
    got = res.tokens + ([0] if res.stop_reason == "eos" else [])
    assert got == want
    assert res.stop_reason == ("eos" if want[-1] == 0 else "length")
    assert len(res.tokens) >= 8, "too short to mean much: pick another prompt"
    assert res.text == decode(tokenizer, res.tokens).decode("utf-8", "replace")
    assert res.prompt_seconds > 0 and res.decode_seconds > 0
    route = f"prefill {len(ids) // chunk}x{chunk} + main {len(ids) % chunk}x1" if prompt == LONG else "main"
    assert res.prompt_route == route


def test_sampling_repeats_with_a_seed_and_differs_across_seeds(fp32_session, tokenizer):
    prompt = gen.chat_tokens(tokenizer, "Hi")

    def run(seed):
        fp32_session.reset()
        s = Sampler(Sampling(temperature=1.5, top_k=50, top_p=0.95, repetition_penalty=1.2, seed=seed))
        return gen.generate(fp32_session, tokenizer, prompt, s, 8).tokens

    first = run(7)
    assert run(7) == first
    fp32_session.reset()
    plain = gen.generate(fp32_session, tokenizer, prompt, greedy(), 8).tokens
    assert any(run(seed) != first for seed in (8, 9)) and first != plain


def test_top_k_top_p_and_repetition_penalty():
    logits = np.array([3.0, 2.0, 1.0, 0.0, -1.0])
    p = np.exp(logits) / np.exp(logits).sum()
    assert np.count_nonzero(filtered_probs(logits, 1.0, 2, 1.0)) == 2
    # nucleus: the smallest set of most likely tokens whose mass reaches top_p
    mass = np.cumsum(p)
    for top_p in (0.5, float(mass[1]) - 1e-9, float(mass[1]) + 1e-9, 0.99):
        kept = np.flatnonzero(filtered_probs(logits, 1.0, 0, top_p))
        assert list(kept) == list(range(int(np.argmax(mass >= top_p)) + 1)), top_p
    np.testing.assert_allclose(filtered_probs(logits, 2.0, 0, 1.0), np.exp(logits / 2) / np.exp(logits / 2).sum())
    np.testing.assert_allclose(penalize(logits, [0, 4, 4], 2.0), [1.5, 2.0, 1.0, 0.0, -2.0])
    assert Sampler(Sampling(repetition_penalty=2.0))(np.array([3.0, 2.0]), [0]) == 1
    draws = [Sampler(Sampling(temperature=1.0, seed=s))(logits) for s in range(400)]
    np.testing.assert_allclose(np.bincount(draws, minlength=5) / 400, p, atol=0.06)
    with pytest.raises(PipelineError, match="--top-p: 0 is out of range"):
        Sampler(Sampling(top_p=0))


def test_streaming_never_splits_a_utf8_character(tokenizer):
    inv = {raw: i for i, raw in tokenizer.trie.vocab.items()}
    one_byte = [inv[bytes([b])] for b in "é🐦".encode()]  # 2 + 4 bytes, one token per byte
    script = one_byte + [inv[b"!"], 0]
    pieces: list[str] = []
    res = gen.generate(Scripted(script), tokenizer, [0], greedy(), 20, on_text=pieces.append)
    assert pieces == ["é", "🐦", "!"]
    assert res.text == "é🐦!" and res.stop_reason == "eos" and res.tokens == script[:-1]
    # bytes that never complete a character become U+FFFD at the end, not lost
    res = gen.generate(Scripted([inv[b"a"], inv[b"\xf0"], inv[b"\x9f"]]), tokenizer, [0], greedy(), 3)
    assert res.text == "a\ufffd" and res.stop_reason == "length"


def test_stop_strings_end_the_text_before_them(tokenizer):
    script = tokenizer.encode("Sure.\n\nUser: next") + [0]
    assert len(script) == 7  # "\n\n", "User" and ":" are separate tokens: the stop string spans three
    pieces: list[str] = []
    res = gen.generate(Scripted(script), tokenizer, [0], greedy(), 50, stop=["\n\nUser:"], on_text=pieces.append)
    assert "".join(pieces) == res.text == "Sure." and res.stop_reason == "stop"
    assert len(res.tokens) == 5  # decoding ended at the ':' that completed the stop string
    # a partial match that does not complete is shown after all
    res = gen.generate(Scripted(tokenizer.encode("a\n\nb") + [0]), tokenizer, [0], greedy(), 50, stop=["\n\nUser:"])
    assert res.text == "a\n\nb" and res.stop_reason == "eos"
    # several stop strings: the earliest in the text wins
    stream = gen.TextStream(["cd", "b"])
    assert stream.push(b"abcd") == "a" and stream.stopped == "b"


def test_without_a_listed_prefill_the_prompt_goes_through_main(tmp_path, tokenizer, fp32_session):
    """An export.json whose functions have no prefill: a DecodeSession over main (same tokens);
    --main-only does the same for a bundle that has one."""
    lay, alt = Layout(RESULTS, M), Layout(tmp_path, M)
    alt.vocab.parent.mkdir(parents=True)
    alt.vocab.symlink_to(lay.vocab)
    alt.aot("universal", "fp32").parent.mkdir(parents=True)
    alt.aot("universal", "fp32").symlink_to(lay.aot("universal", "fp32"))
    alt.export("fp32").mkdir(parents=True)
    record = json.loads((lay.export("fp32") / "export.json").read_text())
    del record["functions"]["prefill"]
    # what an export stage without a prefill would record: sealed, beside the bundle it describes
    (alt.export("fp32") / "export.json").write_text(sealed_text(record, "export"))
    shutil.copytree(lay.export("fp32") / record["bundle"], alt.export("fp32") / record["bundle"], copy_function=os.link)
    ids, n_long = gen.chat_tokens(tokenizer, PROMPT), len(gen.chat_tokens(tokenizer, LONG))
    session, _ = gen.open_bundle(tmp_path, M, "fp32")
    with session:
        assert gen.prompt_route(session, n_long) == "main"
        got = gen.generate(session, tokenizer, ids, greedy(), 6).tokens
    fp32_session.reset()
    assert got == gen.generate(fp32_session, tokenizer, ids, greedy(), 6).tokens
    assert gen.prompt_route(fp32_session, n_long) == f"prefill 1x64 + main {n_long - 64}x1"
    main_only, _ = gen.open_bundle(RESULTS, M, "fp32", use_prefill=False)
    with main_only:
        assert gen.prompt_route(main_only, n_long) == "main"


def test_cli_streams_text_and_reports_both_speeds(capfd):
    conf = str(RESULTS.parent / "config.yaml")
    rc = gen.main(["--config-file", conf, "--model", M, "--recipe", "fp32", "--max-new-tokens", "6", PROMPT])
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert "prompt: 13 tokens in " in err and "tok/s, main); decode: " in err
    assert out.endswith("\n") and len(out) > 1
    rc = gen.main(["--config-file", conf, "--model", M, "--recipe", "nope", PROMPT])
    err = capfd.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and err.startswith("error: ") and "unknown recipe 'nope'" in err
    rc = gen.main(["--config-file", conf, "--model", M, "--recipe", "fp32", "--temperature", "-1", PROMPT])
    err = capfd.readouterr().err
    assert rc == 1 and err == ("error: --temperature: -1.0 is out of range -- fix: use 0 (greedy) or a finite positive "
                               "value of at least 2.2250738585072014e-308\n")


def test_every_runtime_call_returns_with_the_runtime_thread_out_of_python(fp32_session, tokenizer):
    """The runtime hands a result back from its own thread, which then still waits for the GIL
    inside the loop's call_soon_threadsafe (measured: most calls); an interpreter exiting then
    aborted the process (SIGABRT at exit, coreai/runtime.py RuntimeLoop). No call returns so."""
    fp32_session.reset()
    ids = gen.chat_tokens(tokenizer, LONG)
    fp32_session.feed(ids)
    assert fp32_session.runtime_threads_inside == 0
    for tok in ids[:40]:
        fp32_session.step(tok)
        assert fp32_session.runtime_threads_inside == 0


@pytest.mark.parametrize("model", sorted(TINY))
def test_the_cli_exits_0_with_text_for_every_tiny_family(model):
    """A real process per family, its interpreter exit included (Mamba-2's aborted there, 134)."""
    recipe = TINY[model][0]
    proc = subprocess.run([sys.executable, "-m", "recurrent_coreai", "generate", "--config-file",
                           str(RESULTS.parent / "config.yaml"), "--model", model, "--recipe", recipe,
                           "--max-new-tokens", "24", "--temperature", "0.8", "--seed", "3", PROMPT],
                          cwd=ROOT, capture_output=True, timeout=600)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0, err[-2000:]
    assert "C++ exception" not in err
    text = proc.stdout.decode("utf-8")
    assert text.endswith("\n") and text.strip(), f"no text from {model}/{recipe}: {text!r}"
    assert "sampling: seed 3" in err and " decode: " in err and "stopped: " in err


BAD_SAMPLING = [  # (arguments, the exact line on stderr)
    (["--temperature", "1e-320"], "error: --temperature: 1e-320 is out of range -- fix: use 0 (greedy) or a finite "
     "positive value of at least 2.2250738585072014e-308"),
    (["--temperature", "inf"], "error: --temperature: inf is out of range -- fix: use 0 (greedy) or a finite positive "
     "value of at least 2.2250738585072014e-308"),
    (["--temperature", "nan"], "error: --temperature: nan is out of range -- fix: use 0 (greedy) or a finite positive "
     "value of at least 2.2250738585072014e-308"),
    (["--repetition-penalty", "inf"], "error: --repetition-penalty: inf is out of range -- fix: use a finite positive "
     "value of at least 2.2250738585072014e-308; 1 turns it off"),
    (["--repetition-penalty", "nan"], "error: --repetition-penalty: nan is out of range -- fix: use a finite positive "
     "value of at least 2.2250738585072014e-308; 1 turns it off"),
    (["--repetition-penalty", "-1.5"], "error: --repetition-penalty: -1.5 is out of range -- fix: use a finite positive "
     "value of at least 2.2250738585072014e-308; 1 turns it off"),
    (["--repetition-penalty", "0"], "error: --repetition-penalty: 0.0 is out of range -- fix: use a finite positive "
     "value of at least 2.2250738585072014e-308; 1 turns it off"),
    (["--repetition-penalty", "1e-320"], "error: --repetition-penalty: 1e-320 is out of range -- fix: use a finite "
     "positive value of at least 2.2250738585072014e-308; 1 turns it off"),
    (["--top-p", "0"], "error: --top-p: 0.0 is out of range -- fix: use a value in (0, 1]; 1 turns it off"),
    (["--top-p", "1.5"], "error: --top-p: 1.5 is out of range -- fix: use a value in (0, 1]; 1 turns it off"),
    (["--top-p", "nan"], "error: --top-p: nan is out of range -- fix: use a value in (0, 1]; 1 turns it off"),
    (["--top-p", "inf"], "error: --top-p: inf is out of range -- fix: use a value in (0, 1]; 1 turns it off"),
    (["--top-k", "-1"], "error: --top-k: -1 is out of range -- fix: use 0 (off) or a positive count"),
    (["--top-k", "65537", "--temperature", "1"], "error: --top-k: 65537 is more than the model's 65536 tokens -- fix: "
     "use 0 (off) or a count from 1 to 65536"),
    (["--top-k", str(2**64 + 1)], f"error: --top-k: {2**64 + 1} is more than the model's 65536 tokens -- fix: use 0 "
     "(off) or a count from 1 to 65536"),
    (["--top-k", "1e3"], "error: python -m recurrent_coreai generate: argument --top-k: invalid int value: '1e3' -- "
     "fix: see python -m recurrent_coreai generate --help"),
    (["--temperature", "warm"], "error: python -m recurrent_coreai generate: argument --temperature: invalid float "
     "value: 'warm' -- fix: see python -m recurrent_coreai generate --help"),
]


@pytest.mark.parametrize("args,line", BAD_SAMPLING, ids=[" ".join(a) for a, _ in BAD_SAMPLING])
def test_bad_sampling_values_are_one_line(capfd, args, line):
    conf = str(RESULTS.parent / "config.yaml")
    rc = gen.main(["--config-file", conf, "--model", M, "--recipe", "fp32", "--max-new-tokens", "2", *args, PROMPT])
    out, err = capfd.readouterr()
    assert (rc, err) == (1, line + "\n")
    assert out == ""  # refused before any text


@pytest.mark.parametrize("temperature,penalty", [(1e-300, 1.0), (sys.float_info.min, 1.0), (1.0, sys.float_info.min),
                                                 (1e300, 1.0), (1.0, 1e300)])
def test_extreme_accepted_settings_give_a_distribution(temperature, penalty):
    """The smallest and largest accepted temperatures and penalties give finite probabilities
    summing to 1 (no inf - inf = NaN): a tiny temperature is the argmax, a huge one uniform."""
    logits = np.array([3.0, 2.5, -1.0, 7e4, -6e4])
    z = penalize(logits, [0, 3, 4], penalty)
    assert np.isfinite(z).all()
    p = filtered_probs(z, temperature, 0, 1.0)
    assert np.isfinite(p).all() and p.sum() == pytest.approx(1.0)
    if temperature < 1e-200:
        assert p[int(np.argmax(z))] == 1.0
    if temperature > 1e200:
        np.testing.assert_allclose(p, np.full(5, 0.2))
    draws = {Sampler(Sampling(temperature=temperature, repetition_penalty=penalty, seed=s))(logits, [0, 3, 4])
             for s in range(5)}
    assert draws <= set(range(5))
