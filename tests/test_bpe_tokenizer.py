"""The hf-bpe tokenizer kind (recurrent_coreai/tokenizers/bpe.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from recurrent_coreai.tokenizers import bpe
from recurrent_coreai.util.errors import PipelineError

HARD = (
    "User: hi\n\nAssistant:",
    "Emoji: 😀🦢🏳️‍🌈👩🏽‍💻🇯🇵 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈",
    "日本語のテキストと中文文本，한국어 텍스트도 있습니다。 ไทย हिन्दी",
    "NUL\x00inside\x00\x00and\x01\x02\x1f\x7f control",
    "line one\r\nline two\r\n\r\n" + " " * 70 + "\t\t\n",
    "".join(chr(c) for c in range(0x20, 0x250)),
    "\u200b\u200d\ufeff zero-widths, combining e\u0301 and a lone \U0010ffff",
)
BAD_UTF8 = (b"\xff\xfe invalid \x80\x81 utf-8 \xc3 \xed\xa0\x80 end", bytes(range(256)), b"\xf0\x9f\x98", b"ok\xc3")


@pytest.fixture(scope="module")
def tok():
    return bpe.synthetic()


def test_synthetic_shape(tok):
    assert tok.vocab_size == bpe.SYNTHETIC_VOCAB_SIZE == 1024
    assert tok.tok.token_to_id(bpe.EOS) == 0 and tok.special_ids == [0] and tok.token_bytes(0) == b""
    assert len(tok._single) == 256                      # every byte has its own token
    ids = tok.encode("User: hi\n\nAssistant:")
    assert len(ids) < len("User: hi\n\nAssistant:")     # merges learned from the chat strings


def test_bytes_to_unicode_is_gpt2s():
    from tokenizers import pre_tokenizers

    table = bpe.bytes_to_unicode()
    assert len(set(table.values())) == 256 and set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"


@pytest.mark.parametrize("text", HARD)
def test_round_trip_text(tok, text):
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert tok.tok.decode(ids) == text
    assert tok.encode_bytes(text.encode("utf-8")) == ids     # valid UTF-8 bytes: the same ids as the text


@pytest.mark.parametrize("data", BAD_UTF8)
def test_round_trip_invalid_utf8(tok, data):
    ids = tok.encode_bytes(data)
    assert tok.decode_bytes(ids) == data
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_check_round_trip_counts_tokens(tok):
    assert tok.check_round_trip(HARD + BAD_UTF8) > 0


SCRIPT = "from recurrent_coreai.tokenizers import bpe; import sys; sys.stdout.write(bpe.synthetic_tokenizer_json())"


def test_synthetic_same_bytes_in_two_processes():
    """Two processes, one of them asking for a parallel trainer: the same tokenizer.json bytes."""
    runs = []
    for env in ({}, {"TOKENIZERS_PARALLELISM": "true", "RAYON_NUM_THREADS": "2", "PYTHONHASHSEED": "123"}):
        out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, check=True,
                             env={**os.environ, **env}).stdout
        runs.append(out)
    assert runs[0] == runs[1]
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    assert runs[0].decode("utf-8") == bpe.synthetic_tokenizer_json()
    assert os.environ.get("TOKENIZERS_PARALLELISM") == before   # the trainer's one-thread setting is undone


def test_load_verifies(tmp_path, tok):
    path = tmp_path / "tokenizer.json"
    path.write_text(tok.json_text, encoding="utf-8")
    again = bpe.load_file(path, sha256=tok.sha256)
    assert again.table() == tok.table() and again.n_ids == 1024
    with pytest.raises(PipelineError, match="sha256 is"):
        bpe.load_file(path, sha256="0" * 64)
    rows = {"embedding": 1024, "head": 1000}   # every id needs a row in each (tests/test_vocab_fits_model.py)
    with pytest.raises(PipelineError, match="head has 1000 rows, but its tokenizer.json has token ids up to 1023"):
        bpe.fits(tmp_path, {}, rows, "ckpt")
    assert bpe.fits(tmp_path, {}, {**rows, "head": 1024}, "ckpt") == 1024
    with pytest.raises(PipelineError, match="tokenizer.json is missing"):
        bpe.load_file(tmp_path / "nope.json")


def _one_line(exc) -> str:
    assert "\n" not in str(exc)
    return str(exc)


def test_not_byte_level_is_one_line(tmp_path, tok):
    spec = json.loads(tok.json_text)
    spec["model"]["vocab"]["▁word"] = len(spec["model"]["vocab"])   # a SentencePiece-style piece: not byte-level
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(PipelineError) as e:
        bpe.load_file(path)
    assert "'▁word' holds '▁' (U+2581), which is not in the byte-level alphabet" in _one_line(e.value)


def test_broken_json_is_one_line(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": ', encoding="utf-8")
    with pytest.raises(PipelineError) as e:
        bpe.load_file(path)
    assert "is not a valid tokenizer.json" in _one_line(e.value)


def test_non_special_added_token_is_its_text(tok):
    """GPT-NeoX adds runs of spaces as non-special tokens: their bytes are their own text."""
    from tokenizers import AddedToken, Tokenizer

    t = Tokenizer.from_str(tok.json_text)
    t.add_tokens([AddedToken("    ", normalized=False, special=False)])
    t.add_special_tokens(["<|padding|>"])
    ext = bpe.from_json(t.to_str())
    spaces, pad = t.token_to_id("    "), t.token_to_id("<|padding|>")
    assert ext.token_bytes(spaces) == b"    " and ext.token_bytes(pad) == b""
    ids = ext.encode("a    b")
    assert spaces in ids and ext.decode_bytes(ids) == b"a    b"


def test_kind_interface(tmp_path):
    """source_files -> bake_stage -> load: the same tokenizer; the device TSV holds every id's bytes."""
    import base64

    from recurrent_coreai import tokenizers

    kind = tokenizers.kind("hf-bpe")
    assert kind is bpe
    src, out = tmp_path / "source", tmp_path / "vocab"
    src.mkdir()
    kind.source_files(src, {})
    report = kind.bake_stage(src, out, {})
    assert report["entries"] == 1024 and sorted(report["files"]) == sorted(p.name for p in out.iterdir())
    tok = kind.load(out)
    rows = (out / bpe.DEVICE_FILE).read_text().splitlines()
    assert len(rows) == len(tok) == 1024
    assert all(base64.b64decode(r.split("\t")[1]) == tok.token_bytes(int(r.split("\t")[0])) for r in rows)
    assert tok.prompt("hi")[:1] == [0] and tok.decode_bytes(tok.prompt("hi")) == b"User: hi\n\nAssistant:"
    carried = kind.carry(src, tmp_path, {"tokenizer_sha256": tok.sha256, "sha256": "0" * 64})
    assert [p.name for p in carried] == ["tokenizer.json", "tokenizer_config.json"]
    with pytest.raises(PipelineError, match="sha256 is"):
        kind.carry(src, tmp_path, {"tokenizer_sha256": "f" * 64})
