"""`generate`: greedy decoding in the Core AI runtime equals the PyTorch reference's greedy
decoding token for token (fp32 bundle of the session's tiny results tree); seeded sampling
repeats; streamed text never splits a UTF-8 character; stop strings end the text before them;
the prompt goes through ``prefill`` only when export.json lists it."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from recurrent_coreai.tools import generate as gen
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.pipeline.records import sealed_text
from recurrent_coreai.tools.sampling import Sampler, Sampling, filtered_probs, penalize
from recurrent_coreai import tokenizers

RESULTS = None  # the tiny results tree (conftest)
M = "rwkv7-tiny"
PROMPT = "Hello, who are you?"


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
    assert rc == 1 and err == "error: --temperature: -1.0 is out of range -- fix: use 0 (greedy) or a positive value\n"
