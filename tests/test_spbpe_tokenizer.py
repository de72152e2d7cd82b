"""The sp-bpe tokenizer kind (recurrent_coreai/tokenizers/spbpe.py): SentencePiece-style BPE with
byte fallback (Llama / Mistral / Gated DeltaNet tokenizer.json), checked against the official
``sentencepiece`` library and a tokenizer.json transformers converts from its model."""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import sys

import pytest

from recurrent_coreai import tokenizers
from recurrent_coreai.tokenizers import bpe, spbpe
from recurrent_coreai.util.errors import PipelineError

SPACE = "\u2581"
HARD = (
    "User: hi\n\nAssistant:",
    "Emoji: 😀🦢🏳️‍🌈👩🏽‍💻🇯🇵 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈",
    "日本語のテキストと中文文本，한국어 텍스트도 있습니다。 ไทย हिन्दी",
    " one leading space", "   three leading spaces", "trailing spaces   ", "  both  ", " ", "   ", "a  b   c    d",
    "\nnewline first", "line one\nline two\n\n\nthree newlines\n", "line one\r\nline two\r\n\r\n",
    "\ttab first\tand\t\ttabs\t", " \t \n mixed \n\t ",
    "NUL\x00inside\x00\x00and\x01\x02\x1f\x7f control",
    "".join(chr(c) for c in range(0x20, 0x250)),
    "\u200b\u200d\ufeff zero-widths, combining e\u0301 and a lone \U0010ffff",
    "<s>literal</s> <unk> <0x41> <0xZZ> look like tokens but are text",
)
BAD_UTF8 = (b"\xff\xfe invalid \x80\x81 utf-8 \xc3 \xed\xa0\x80 end", bytes(range(256)), b"\xf0\x9f\x98", b"ok\xc3",
            b"\xff", b" \xff ", b"\xc3 starts invalid", b"two  \xe2\x82 spaces  \xff")


def _one_line(exc) -> str:
    assert "\n" not in str(exc)
    return str(exc)


@pytest.fixture(scope="module")
def tok():
    return spbpe.synthetic()


# --- the synthetic tokenizer -------------------------------------------------------------------
def test_synthetic_shape(tok):
    spec = json.loads(tok.json_text)
    assert tok.n_ids == len(tok) == spbpe.SYNTHETIC_VOCAB_SIZE == 1024
    assert [tok.tok.id_to_token(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    assert [tok.tok.id_to_token(3 + b) for b in range(256)] == [f"<0x{b:02X}>" for b in range(256)]   # as Llama
    assert [a["content"] for a in spec["added_tokens"]] == ["<unk>", "<s>", "</s>"]   # bytes: model vocab, not added
    assert spec["model"]["byte_fallback"] is True and spec["normalizer"] is None and tok.spelling == "metaspace"
    assert spec["pre_tokenizer"] == {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "first", "split": False}
    assert (tok.bos, tok.eos, tok.special_ids) == (1, 2, [0, 1, 2])
    assert all(tok.token_bytes(i) == b"" for i in range(3))
    ids = tok.encode("User: hi\n\nAssistant:")
    assert len(ids) < len("User: hi\n\nAssistant:") / 2             # merges learned from the chat strings
    assert tok.encode("😀") == [tok.space_id] + [3 + b for b in "😀".encode()]   # emoji: left to byte fallback


SCRIPT = "from recurrent_coreai.tokenizers import spbpe; import sys; sys.stdout.write(spbpe.synthetic_tokenizer_json())"


def test_synthetic_same_bytes_in_two_processes():
    """Two processes, one of them asking for a parallel trainer and another hash seed: the same bytes."""
    runs = []
    for env in ({}, {"TOKENIZERS_PARALLELISM": "true", "RAYON_NUM_THREADS": "2", "PYTHONHASHSEED": "123"}):
        runs.append(subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, check=True,
                                   env={**os.environ, **env}).stdout)
    assert runs[0] == runs[1]
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    assert runs[0].decode("utf-8") == spbpe.synthetic_tokenizer_json()
    assert os.environ.get("TOKENIZERS_PARALLELISM") == before


def test_vocab_size_is_a_setting_capped_by_the_model(tmp_path):
    assert spbpe.synthetic(512).n_ids == 512
    for model_vocab, want in ((32000, 1024), (600, 600), (None, 1024)):
        out = tmp_path / str(model_vocab)
        out.mkdir()
        spbpe.source_files(out, {} if model_vocab is None else {"vocab_size": model_vocab})
        assert spbpe.load_file(out / "tokenizer.json").n_ids == want
    with pytest.raises(ValueError, match="choose at least 261"):
        spbpe.synthetic_tokenizer_json(260)


# --- every id's bytes; round trips -----------------------------------------------------------
def _rule(spec: dict) -> dict[int, bytes]:
    """Each id's bytes, computed here from the JSON: <0xNN> a byte, ▁ a space, special tokens nothing."""
    out = {}
    for piece, i in spec["model"]["vocab"].items():
        out[i] = (bytes([int(piece[3:5], 16)]) if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
                  else piece.replace(SPACE, " ").encode("utf-8"))
    for a in spec["added_tokens"]:
        out[a["id"]] = b"" if a["special"] else a["content"].encode("utf-8")
    return out


def test_every_id_has_its_bytes(tok):
    from tokenizers import Tokenizer

    rule = _rule(json.loads(tok.json_text))
    assert sorted(rule) == list(range(tok.n_ids)) and tok.table() == rule
    assert tok.token_bytes(tok.space_id) == b" " and tok.token_bytes(3 + 0x0A) == b"\n" and tok.token_bytes(3 + 0xFF) == b"\xff"
    own = Tokenizer.from_str(tok.json_text)   # the file's own decoder, as the library reads it
    a = own.token_to_id("<0x41>")
    for i in range(tok.n_ids):
        if not 3 <= i < 259:
            assert own.decode([a, i]).encode("utf-8") == b"A" + rule[i], i
    # a piece whose bytes start with a space loses it at the start of a text, not after another token
    word = next(i for i in range(259, tok.n_ids) if tok.tok.id_to_token(i).startswith(SPACE) and len(tok.tok.id_to_token(i)) > 2)
    assert tok.decode_bytes([word]) == rule[word][1:] and tok.decode_bytes([a, word]) == b"A" + rule[word]


@pytest.mark.parametrize("text", HARD)
def test_round_trip_text(tok, text):
    ids = tok.encode(text)
    assert tok.decode_bytes(ids) == text.encode("utf-8")
    assert b"".join(tok.token_bytes(i) for i in ids) == b" " + text.encode("utf-8")   # the dummy prefix, kept
    assert tok.tok.decode(ids) == text
    assert tok.encode_bytes(text.encode("utf-8")) == ids
    assert all(0 <= i < tok.n_ids for i in ids) and 0 not in ids   # byte fallback: never <unk>


@pytest.mark.parametrize("data", BAD_UTF8)
def test_round_trip_invalid_utf8(tok, data):
    ids = tok.encode_bytes(data)
    assert tok.decode_bytes(ids) == data
    assert all(0 < i < tok.n_ids for i in ids)


def test_check_round_trip_counts_tokens(tok):
    assert tok.check_round_trip(HARD + BAD_UTF8) > 0
    assert tok.check_round_trip() > 0


def test_the_leading_space_rule_against_the_library_s_metaspace(tok):
    """The library's Metaspace drops the dummy prefix of a text that starts with a space (so its
    own decode loses it); this kind encodes as SentencePiece and keeps it. Elsewhere: the same ids."""
    from tokenizers import Tokenizer

    own = Tokenizer.from_str(tok.json_text)
    assert own.decode(own.encode(" hi", add_special_tokens=False).ids) == "hi"           # the library's loss
    assert tok.decode_bytes(tok.encode(" hi")) == b" hi" and tok.tok.decode(tok.encode(" hi")) == " hi"
    for text in HARD:
        if not text.startswith(" ") and "<" not in text:
            assert own.encode(text, add_special_tokens=False).ids == tok.encode(text), text
    assert tok.encode("") == [] and tok.decode_bytes([]) == b""
    assert tok.decode_bytes(tok.encode(f"a{SPACE}b")) == b"a b"   # U+2581 in a text is a space to SentencePiece


# --- the official libraries: sentencepiece trains, transformers converts -------------------------
@pytest.fixture(scope="module")
def official(tmp_path_factory):
    """A tiny SentencePiece BPE with byte fallback (Llama's trainer settings), its tokenizer.json as
    transformers 5 writes it (Metaspace spelling) and re-spelled as Llama-2's older files are."""
    import sentencepiece as spm
    from transformers import LlamaTokenizerFast

    d = tmp_path_factory.mktemp("official")
    lines = sorted(bpe.SYNTHETIC_CORPUS.splitlines())
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(d / "tokenizer"), model_type="bpe", vocab_size=900,
        byte_fallback=True, character_coverage=0.98, num_threads=1, split_digits=True,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    newer = json.loads(LlamaTokenizerFast.from_pretrained(str(d)).backend_tokenizer.to_str())
    older = copy.deepcopy(newer)
    older["pre_tokenizer"] = None
    older["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": SPACE}, {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]}
    bare = copy.deepcopy(newer)
    bare["decoder"] = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "first", "split": False}
    return sp, {"newer": newer, "older": older, "metaspace-decoder": bare}


@pytest.mark.parametrize("spelling", ["newer", "older", "metaspace-decoder"])
def test_a_file_transformers_converted_encodes_as_sentencepiece(official, spelling):
    sp, files = official
    spec = files[spelling]
    assert spec["model"]["byte_fallback"] is True and sp.get_piece_size() == 900
    tok = spbpe.from_json(json.dumps(spec, ensure_ascii=False))
    assert tok.spelling == ("prepend" if spelling == "older" else "metaspace") and tok.n_ids == 900
    assert (tok.bos, tok.eos) == (sp.bos_id(), sp.eos_id()) == (1, 2)
    fallback = 0
    for text in spbpe.CHECK_CORPUS + HARD:
        ids = tok.encode(text)
        assert ids == sp.encode(text), text
        assert tok.decode_bytes(ids) == sp.decode(ids).encode("utf-8") == text.encode("utf-8")
        fallback += sum(3 <= i < 259 for i in ids)
    assert fallback > 50   # the check corpus went through byte fallback (character_coverage 0.98)
    for i in range(900):   # every id's bytes: sentencepiece's own piece text (▁ a space) or byte
        want = bytes([int(sp.id_to_piece(i)[3:5], 16)]) if sp.is_byte(i) else (
            b"" if sp.is_control(i) or sp.is_unknown(i) else sp.id_to_piece(i).replace(SPACE, " ").encode())
        assert tok.token_bytes(i) == want, i


# --- refusals: each one line -------------------------------------------------------------------
def _refused(tmp_path, spec_or_text, kind=spbpe) -> str:
    path = tmp_path / "tokenizer.json"
    path.write_text(spec_or_text if isinstance(spec_or_text, str) else json.dumps(spec_or_text, ensure_ascii=False),
                    encoding="utf-8")
    with pytest.raises(PipelineError) as e:
        kind.load_file(path)
    line = _one_line(e.value)
    assert str(path) in line
    return line


def test_a_byte_level_file_is_refused_naming_hf_bpe(tmp_path):
    line = _refused(tmp_path, bpe.synthetic_tokenizer_json())
    assert "is a byte-level BPE (ByteLevel pre-tokenizer / decoder), not a SentencePiece-style one" in line
    assert "use the hf-bpe tokenizer kind" in line


def test_hf_bpe_refuses_an_sp_bpe_file_naming_sp_bpe(tmp_path, tok):
    line = _refused(tmp_path, tok.json_text, kind=bpe)
    assert "is a SentencePiece-style BPE (byte_fallback, '▁' for spaces), not a byte-level one" in line
    assert "use the sp-bpe tokenizer kind" in line


def test_a_missing_byte_token_is_refused(tmp_path, tok):
    spec = json.loads(tok.json_text)
    del spec["model"]["vocab"]["<0x41>"]
    assert "has no byte token <0x41> (1 of the 256 missing from the model's vocabulary)" in _refused(tmp_path, spec)


def test_byte_fallback_false_is_refused(tmp_path, tok):
    spec = json.loads(tok.json_text)
    spec["model"]["byte_fallback"] = False
    assert "its BPE model has byte_fallback false: a character outside the vocabulary would become <unk>" in \
        _refused(tmp_path, spec)


def test_an_added_token_gap_is_refused(tmp_path, tok):
    spec = json.loads(tok.json_text)
    spec["added_tokens"].append({"id": 5000, "content": "<|im_start|>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    assert ("added token '<|im_start|>' has id 5000, which leaves a gap after the ids before it (or repeats one): the "
            "tokenizers library would renumber it to 1024") in _refused(tmp_path, spec)


def test_other_refusals_are_one_line(tmp_path, tok):
    spec = json.loads(tok.json_text)
    unigram = {**spec, "model": {"type": "Unigram", "unk_id": 0, "vocab": [["<unk>", 0.0]], "byte_fallback": True}}
    assert "model type is 'Unigram', not 'BPE'" in _refused(tmp_path, unigram)
    other = {**spec, "pre_tokenizer": {"type": "Whitespace"}}
    assert "is not a SentencePiece spelling the sp-bpe kind knows" in _refused(tmp_path, other)
    never = {**spec, "pre_tokenizer": {**spec["pre_tokenizer"], "prepend_scheme": "never"}}
    assert "is not a SentencePiece spelling the sp-bpe kind knows" in _refused(tmp_path, never)
    no_strip = {**spec, "decoder": {**spec["decoder"], "decoders": spec["decoder"]["decoders"][:3]}}
    assert "its own decoder does not return check string 0" in _refused(tmp_path, no_strip)
    no_bytes = {**spec, "decoder": {**spec["decoder"], "decoders": [d for d in spec["decoder"]["decoders"]
                                                                     if d["type"] != "ByteFallback"]}}
    assert "its decoder gives '<0x41>' for the byte token <0x41>, not 'A'" in _refused(tmp_path, no_bytes)
    underscore = copy.deepcopy(spec)
    underscore["decoder"]["decoders"][0]["content"] = "_"
    word = next(i for p, i in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]) if p.startswith(SPACE))
    assert (f"token {word} {tok.tok.id_to_token(word)!r} decodes to b'_' through its decoder, but the sp-bpe rule "
            "gives b' '") in _refused(tmp_path, underscore)
    assert "is not a valid tokenizer.json" in _refused(tmp_path, '{"model": ')
    with pytest.raises(PipelineError, match="tokenizer.json is missing"):
        spbpe.load_file(tmp_path / "nope" / "tokenizer.json")


# --- settings: eos / bos from tokenizer_config.json ---------------------------------------------
def test_settings_come_from_tokenizer_config(tmp_path, tok):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text(tok.json_text, encoding="utf-8")
    assert (spbpe.load_file(src / "tokenizer.json").bos, spbpe.load_file(src / "tokenizer.json").eos) == (1, 2)
    cfg = src / "tokenizer_config.json"
    cfg.write_text(json.dumps({"bos_token": {"__type": "AddedToken", "content": "<s>"}, "eos_token": "</s>"}))
    t = spbpe.load_file(src / "tokenizer.json")
    assert (t.bos, t.eos, t.card_eos) == (1, 2, 2) and t.chat_description == spbpe.CHAT_DESCRIPTION
    report = spbpe.bake_stage(src, tmp_path / "v1", {})
    assert report["files"] == ["tokenizer.json", "spbpe_vocab.tsv"]   # the defaults: nothing more to carry
    cfg.write_text(json.dumps({"bos_token": None, "eos_token": "<unk>"}))   # null: the default
    t = spbpe.load_file(src / "tokenizer.json")
    assert (t.bos, t.eos) == (1, 0) and t.chat_description.endswith("end of text = <unk>")
    assert t.prompt("hi")[0] == 1
    report = spbpe.bake_stage(src, tmp_path / "v2", {})
    assert report["files"] == ["tokenizer.json", "spbpe_vocab.tsv", "tokenizer_config.json"]
    assert spbpe.load(tmp_path / "v2").eos == 0   # the vocab output keeps the setting
    cfg.write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(PipelineError) as e:
        spbpe.load_file(src / "tokenizer.json")
    assert f"{cfg}: eos_token '<|im_end|>' is not a token of {src / 'tokenizer.json'}" in _one_line(e.value)
    cfg.write_text("[1, 2")
    with pytest.raises(PipelineError) as e:
        spbpe.load_file(src / "tokenizer.json")
    assert f"{cfg}: is not valid JSON" in _one_line(e.value)
    cfg.write_text(json.dumps({"eos_token": 7}))
    with pytest.raises(PipelineError) as e:
        spbpe.load_file(src / "tokenizer.json")
    assert "eos_token is 7, not a token" in _one_line(e.value)


def test_hf_bpe_settings_come_from_tokenizer_config(tmp_path):
    """The same settings in the byte-level kind; its defaults (and its baked files) unchanged."""
    from tokenizers import Tokenizer

    t = Tokenizer.from_str(bpe.synthetic_tokenizer_json())
    t.add_special_tokens(["<|im_end|>"])
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text(t.to_str(), encoding="utf-8")
    base = bpe.load_file(src / "tokenizer.json")
    assert (base.bos, base.eos, base.chat_description) == (0, 0, bpe.CHAT_DESCRIPTION)
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    got = bpe.load_file(src / "tokenizer.json")
    assert (got.bos, got.eos) == (0, 1024) and got.prompt("hi")[0] == 0
    assert got.chat_description == "<|endoftext|>, then 'User: {prompt}\\n\\nAssistant:'; end of text = <|im_end|>"
    assert bpe.bake_stage(src, tmp_path / "vocab", {})["files"][-1] == "tokenizer_config.json"
    assert bpe.load(tmp_path / "vocab").eos == 1024


# --- the kind interface ------------------------------------------------------------------------
def test_kind_interface(tmp_path):
    """source_files -> fits -> bake_stage -> load: the same tokenizer; the device TSV holds every id's bytes."""
    kind = tokenizers.kind("sp-bpe")
    assert kind is spbpe
    src, out = tmp_path / "source", tmp_path / "vocab"
    src.mkdir()
    kind.source_files(src, {"vocab_size": 32000})
    assert kind.fits(src, {}, {"embedding": 32000, "head": 32000}, "ckpt") == 1024
    with pytest.raises(PipelineError, match="head has 1000 rows, but its tokenizer.json has token ids up to 1023"):
        kind.fits(src, {}, {"embedding": 1024, "head": 1000}, "ckpt")
    report = kind.bake_stage(src, out, {})
    assert report["entries"] == 1024 and sorted(report["files"]) == sorted(p.name for p in out.iterdir())
    assert report["files"] == ["tokenizer.json", "spbpe_vocab.tsv"]
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    tok = kind.load(out)
    rows = (out / spbpe.DEVICE_FILE).read_text(encoding="ascii").splitlines()
    assert len(rows) == tok.n_ids == 1024
    assert [int(r.split("\t")[0]) for r in rows] == list(range(1024))
    assert all(base64.b64decode(r.split("\t")[1]) == tok.token_bytes(int(r.split("\t")[0])) for r in rows)
    assert rows[:3] == ["0\t", "1\t", "2\t"] and rows[3 + 0x41] == f"{3 + 0x41}\tQQ=="
    prompt = tok.prompt("hi")
    assert prompt[0] == 1 and tok.decode_bytes(prompt) == b"User: hi\n\nAssistant:"
    assert tok.decode_bytes(tok.prompt("hi", chat=False)) == b"hi"
    assert (tok.eos, tok.card_eos) == (2, 2)
    assert tok.chat_description == spbpe.CHAT_DESCRIPTION == "<s>, then 'User: {prompt}\\n\\nAssistant:'; end of text = </s>"
    carried = kind.carry(src, tmp_path, {"tokenizer_sha256": tok.sha256})
    assert [p.name for p in carried] == ["tokenizer.json", "tokenizer_config.json"]
    with pytest.raises(PipelineError, match="sha256 is"):
        kind.carry(src, tmp_path, {"tokenizer_sha256": "f" * 64})
