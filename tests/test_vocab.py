"""World vocab: pinned package file, sha256 check, TSV bake and its verification."""

from __future__ import annotations

import base64

import pytest

from recurrent_coreai.tokenizers import world as vocab
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.tokenizers.trie import TrieTokenizer


@pytest.fixture(scope="module")
def baked(tmp_path_factory, cfg):
    v = cfg["vocab"]
    out = tmp_path_factory.mktemp("vocab") / "rwkv_vocab.tsv"
    import pyrwkv_tokenizer

    report = vocab.bake(vocab.package_vocab(v["package"], v["version"], v["file"], v["sha256"]), out,
                        official=pyrwkv_tokenizer.RWKVTokenizer())
    return out, report


def test_tsv_format(baked, world_vocab):
    path, report = baked
    data = path.read_bytes()
    assert b"\r" not in data and data.endswith(b"\n")
    lines = data.decode("ascii").splitlines()
    assert len(lines) == 65529 == report["entries"]
    ids = [int(line.split("\t")[0]) for line in lines]
    assert ids == sorted(ids) == list(range(1, 65530))
    assert lines[0] == "1\t" + base64.b64encode(b"\x00").decode()
    assert all(base64.b64decode(line.split("\t")[1]) == world_vocab[i] for i, line in zip(ids, lines))
    assert report["checked_official"] >= 9


def test_corpus_covers_the_hard_cases():
    joined = b"".join(vocab.CHECK_CORPUS)
    assert b"\x00" in joined and b"\r\n" in joined and " " * 100 in joined.decode("utf-8", "replace")
    assert "😀".encode() in joined and "日本語".encode() in joined
    with pytest.raises(UnicodeDecodeError):
        b"".join(t for t in vocab.CHECK_CORPUS if b"\xff" in t).decode("utf-8")


def test_known_encodings(baked):
    tok = TrieTokenizer(vocab.read_tsv(baked[0]))
    assert tok.encode("\n\n") == [261]
    assert tok.encode("User: hi\n\nAssistant:") == [24281, 59, 4571, 261, 5585, 41693, 59]
    assert tok.decode([0, 261]) == b"\n\n"


def test_wrong_sha256_is_refused(cfg):
    v = cfg["vocab"]
    with pytest.raises(PipelineError) as exc:
        vocab.package_vocab(v["package"], v["version"], v["file"], "0" * 64)
    msg = str(exc.value)
    assert "rwkv_vocab_v20230424.txt: sha256 is e6dee3d4" in msg and "expected 0000" in msg and "-- fix:" in msg


def test_missing_package_file_is_refused(cfg):
    v = cfg["vocab"]
    with pytest.raises(PipelineError, match="has no file no_such_vocab.txt"):
        vocab.package_vocab(v["package"], v["version"], "no_such_vocab.txt", v["sha256"])
    with pytest.raises(PipelineError, match="is not installed"):
        vocab.package_vocab("no-such-package-xyz", "1.0", v["file"], v["sha256"])
    with pytest.raises(PipelineError, match="version 0.9.1 is installed, config pins 0.9.0"):
        vocab.package_vocab(v["package"], "0.9.0", v["file"], v["sha256"])


@pytest.mark.parametrize("damage, needle", [
    (lambda lines: lines.__setitem__(300, lines[300].split("\t")[0] + "\t" + base64.b64encode(b"xx").decode()),
     "token 301 decodes to b'xx'"),
    (lambda lines: lines.pop(5), "has 65528 entries"),
    (lambda lines: lines.__setitem__(7, "7\t!!notbase64"), "bad line"),
])
def test_damaged_tsv_fails_verification(baked, world_vocab, tmp_path, damage, needle):
    lines = baked[0].read_text().splitlines()
    damage(lines)
    bad = tmp_path / "bad.tsv"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(PipelineError, match=needle):
        vocab.verify_bake(world_vocab, bad)


def test_tokenizer_mismatch_is_caught(world_vocab, tmp_path):
    """A TSV whose entries decode right but whose tokenizer differs (an id missing from the trie
    changes the greedy split) must fail check (b)."""
    broken = dict(world_vocab)
    longest = max(broken, key=lambda i: len(broken[i]))
    text = vocab.tsv_text(broken).replace(f"{longest}\t", f"{longest}\t", 1)
    path = tmp_path / "v.tsv"
    path.write_text(text)
    original = dict(world_vocab)
    original[longest] = world_vocab[longest] + b"!"  # the "original" now disagrees on one token
    with pytest.raises(PipelineError):
        vocab.verify_bake(original, path)
