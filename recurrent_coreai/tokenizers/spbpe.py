"""The ``sp-bpe`` tokenizer kind: a SentencePiece-style BPE ``tokenizer.json`` with byte fallback
(Llama / Mistral style, what Gated DeltaNet checkpoints ship: 32000 tokens, ``<unk>`` ``<s>``
``</s>`` at 0..2, the 256 ``<0x00>`` .. ``<0xFF>`` byte tokens, ``▁`` (U+2581) for a space), loaded
and verified with the ``tokenizers`` library, plus a small deterministic one for synthetic models.
Modelled on the byte-level kind (bpe.py), whose helpers it shares.

Spellings accepted (both are in the wild; anything else is one line naming what it found):

* older Llama-2 / Mistral files: ``normalizer`` Sequence[Prepend("▁"), Replace(" ", "▁")],
  ``pre_tokenizer`` null;
* newer files: ``normalizer`` null, ``pre_tokenizer`` Metaspace(replacement "▁", prepend_scheme
  "first" or "always"; any ``split``);

with a decoder Sequence[Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0)] or a bare
Metaspace. A byte-level file (a ByteLevel pre-tokenizer or decoder) is refused with one line naming
the ``hf-bpe`` kind.

Encoding is SentencePiece's own (tested identical to the ``sentencepiece`` library on
:data:`CHECK_CORPUS`, tests/test_spbpe_tokenizer.py): one "dummy prefix" ``▁`` before the text,
every space escaped to ``▁``, no split at spaces, special tokens never parsed out of the text (a
prompt's ``</s>`` is text). Both spellings are encoded through the older one's pipeline (the
tokenizers library with the Prepend + Replace normalizer and ``encode_special_tokens``): the
library's Metaspace pre-tokenizer leaves the dummy prefix out of a text that begins with a space
(so its own decode loses that space) and, with ``split`` true, splits runs of spaces; SentencePiece
does neither. A file's ``truncation`` and ``padding`` are ignored. A U+2581 in the input text is a
space to SentencePiece and comes back as one (not in the check corpus).

The leading-space rule. Every non-empty encoding starts with the dummy prefix, so the token bytes
of a text joined are ``b" " + text``. :meth:`SPBPETokenizer.token_bytes` (and the device table
``spbpe_vocab.tsv``) give each id's bytes as they are: ``<0xNN>`` -> that byte, any other piece its
UTF-8 with ``▁`` as a space (``▁Hello`` -> ``b" Hello"``), special tokens (``<unk>``, ``<s>``,
``</s>``) ``b""``, a non-special added token its text. :meth:`SPBPETokenizer.decode_bytes` decodes a
whole text from its start: the joined bytes less their first byte when that is a space (0x20), as
SentencePiece and the decoder's Strip(" ", 1, 0) do. A stream that continues a prompt (generate,
a device app) joins ``token_bytes`` and drops nothing: the continuation's first space is a real one.
A device app decoding a whole text from its start drops that one leading space itself.

Verification on load (each problem one line naming the file): model BPE with ``byte_fallback``
true; every ``<0xNN>`` in the model's vocabulary; a ``▁`` token; ids contiguous ``0 .. n - 1``, an
added-token gap refused as bpe.py does; every id's bytes by the rule above equal to what the
file's decoder gives for it (each id decoded after ``<0x41>``, so the Strip leaves it alone; the
byte tokens 0x80..0xFF, no text alone, by their ``<0xNN>`` spelling); :data:`CHECK_CORPUS` round-tripped byte-exactly
through :meth:`SPBPETokenizer.decode_bytes` and through the library's decoder (a bare Metaspace
decoder cannot decode byte-fallback tokens, ``<0x0A>`` stays text: the SentencePiece decoder
sequence above stands in for it).

Settings (the kind's, as bpe.py's): ``eos_token`` / ``bos_token`` from the ``tokenizer_config.json``
beside the tokenizer.json (bpe.config_tokens), else the defaults :data:`EOS` ``</s>`` and :data:`BOS`
``<s>``; a token the file names must be in the vocabulary. The prompt: ``<s>``, then the chat text
:data:`CHAT` (bpe.py's, plain text: a base model has no chat template), end of text ``</s>``;
:data:`CHAT_DESCRIPTION` says so for the card, the loaded tokenizer's ``chat_description`` and
``card_eos`` with this model's settings. ``tokenizer_sha256`` (``PIN``) and ``vocab_size`` as in
bpe.py.

The synthetic tokenizer (:func:`synthetic_tokenizer_json`): trained with the tokenizers library on
bpe.py's :data:`~recurrent_coreai.tokenizers.bpe.SYNTHETIC_CORPUS` (Metaspace words, as
SentencePiece splits them), ``<unk>`` ``<s>`` ``</s>`` at 0..2 and the 256 byte tokens at 3..258 as
Llama, then the alphabet (the corpus's most frequent characters, up to half of the room left; the
rarest, the emoji among them, go through byte fallback) and merges up to ``vocab_size`` (default
1024); written in the newer spelling. The same bytes on every run: one thread, the sorted corpus,
the alphabet chosen here (the trainer's own cut breaks ties in hash order), sorted-keys JSON.

Shared layer: no family imports.
"""

from __future__ import annotations

import base64
import collections
import copy
import json
import re
from pathlib import Path
from typing import Iterable, Mapping

from recurrent_coreai.tokenizers import bpe
from recurrent_coreai.util.errors import PipelineError

UNK, BOS, EOS = "<unk>", "<s>", "</s>"   # ids 0, 1, 2 in Llama; BOS / EOS: the kind's defaults
DEFAULTS = {"eos_token": EOS, "bos_token": BOS}
SPACE = "\u2581"   # ▁
BYTE_PIECES = tuple(f"<0x{b:02X}>" for b in range(256))
SYNTHETIC_VOCAB_SIZE = 1024
TOKENIZER_FILE = bpe.TOKENIZER_FILE
CONFIG_FILE = bpe.CONFIG_FILE
DEVICE_FILE = "spbpe_vocab.tsv"   # id \t base64(token bytes), ids ascending (special tokens: empty)
# the smallest synthetic shape.vocab (config check): 3 specials, 256 byte pieces and an alphabet of 2 (a
# checkpoint's ids are its tokenizer file's, checked against the model by fits in the source stage)
MIN_VOCAB = 3 + 256 + 2
CARRY = bpe.CARRY
CHAT = bpe.CHAT
DESCRIPTION = (f"SentencePiece-style BPE with byte fallback (Hugging Face tokenizer.json, Llama/Mistral style); "
               f"{DEVICE_FILE}: id TAB base64 bytes, '▁' as a space, a whole text drops its first space "
               "(SentencePiece's dummy prefix)")
CHAT_DESCRIPTION = bpe.describe_chat(BOS, EOS)

# Strings every loaded tokenizer must round-trip byte-exactly: bpe.py's, then what only this kind is
# asked (a single leading space, control-token and byte-token spellings as plain text).
CHECK_CORPUS: tuple[str, ...] = bpe.CHECK_CORPUS + (
    " one leading space",
    "<s> and </s> and <unk> and <0x41> are text here",
)

_PREPEND = {"type": "Prepend", "prepend": SPACE}
_ESCAPE = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
NORMALIZER = {"type": "Sequence", "normalizers": [_PREPEND, _ESCAPE]}   # the older spelling: SentencePiece's
DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _is_escape(node) -> bool:
    return (isinstance(node, dict) and node.get("type") == "Replace" and node.get("content") == SPACE
            and node.get("pattern") in ({"String": " "}, {"Regex": " "}))


def _short(node) -> str:
    return "null" if node is None else json.dumps(node, ensure_ascii=False, sort_keys=True)[:120]


def spelling(spec: Mapping, where: str | Path) -> str:
    """Which accepted spelling ``spec`` is (``"prepend"`` or ``"metaspace"``); one line otherwise."""
    norm, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
    steps = norm.get("normalizers") if isinstance(norm, dict) and norm.get("type") == "Sequence" else None
    if pre is None and steps is not None and len(steps) == 2 and steps[0] == _PREPEND and _is_escape(steps[1]):
        return "prepend"
    if (norm is None and isinstance(pre, dict) and pre.get("type") == "Metaspace" and pre.get("replacement") == SPACE
            and (pre.get("prepend_scheme") in ("first", "always")
                 or ("prepend_scheme" not in pre and pre.get("add_prefix_space") is True))):
        return "metaspace"
    raise PipelineError(where, f"normalizer {_short(norm)} with pre_tokenizer {_short(pre)} is not a SentencePiece "
                        "spelling the sp-bpe kind knows", "use a Llama/Mistral tokenizer.json: normalizer "
                        "Prepend('▁') + Replace(' ', '▁') and no pre-tokenizer, or no normalizer and a Metaspace('▁') "
                        "pre-tokenizer that prepends")


class SPBPETokenizer:
    """A verified SentencePiece-style BPE tokenizer (from :func:`load` or :func:`from_json`)."""

    def __init__(self, text: str, where: str | Path = "tokenizer.json", settings: Mapping | None = None):
        from tokenizers import Tokenizer

        self.where = str(where)
        self.json_text = text
        self.sha256 = bpe.sha256_bytes(text.encode("utf-8"))
        spec, own = bpe.parse(text, where)
        if any(bpe.has_type(spec.get(k), "ByteLevel") for k in ("pre_tokenizer", "decoder", "post_processor", "normalizer")):
            raise PipelineError(where, "is a byte-level BPE (ByteLevel pre-tokenizer / decoder), not a SentencePiece-style "
                                "one", "use the hf-bpe tokenizer kind for it (the family's tokenizer attribute)")
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise PipelineError(where, f"model type is {model.get('type')!r}, not 'BPE'",
                                "the sp-bpe tokenizer kind takes a SentencePiece-style BPE tokenizer.json (Llama/Mistral)")
        if model.get("byte_fallback") is not True:
            raise PipelineError(where, f"its BPE model has byte_fallback {json.dumps(model.get('byte_fallback'))}: a "
                                "character outside the vocabulary would become <unk>", "the sp-bpe kind takes a BPE "
                                "with byte_fallback true (a Llama/Mistral tokenizer.json)")
        self.spelling = spelling(spec, where)
        self.added = bpe.check_added_ids(own, spec, where)
        vocab = model.get("vocab") or {}
        missing = [p for p in BYTE_PIECES if p not in vocab]
        if missing:
            raise PipelineError(where, f"has no byte token {missing[0]} ({len(missing)} of the 256 missing from the "
                                "model's vocabulary)", "a byte-fallback BPE holds all 256 <0x00>..<0xFF> tokens in "
                                "its model vocab (use the checkpoint's own tokenizer.json)")
        if SPACE not in vocab:
            raise PipelineError(where, "has no '▁' token (the word boundary every SentencePiece vocabulary holds)",
                                "use the checkpoint's own tokenizer.json")
        # the encoding pipeline: SentencePiece's (the module doc), in the tokenizers library
        canon = copy.deepcopy(spec)
        canon.update(normalizer=NORMALIZER, pre_tokenizer=None, truncation=None, padding=None)
        if isinstance(spec.get("decoder"), dict) and spec["decoder"].get("type") == "Metaspace":
            canon["decoder"] = DECODER   # a bare Metaspace decoder leaves <0xNN> as text
        self.tok = Tokenizer.from_str(json.dumps(canon, ensure_ascii=False))
        canon["normalizer"] = _ESCAPE   # a continuation (encode_bytes after an invalid byte): no dummy prefix
        self._cont = Tokenizer.from_str(json.dumps(canon, ensure_ascii=False))
        for t in (self.tok, self._cont):
            t.encode_special_tokens = True
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self._bytes: list[bytes] = []
        for i in range(self.vocab_size):
            piece = self.tok.id_to_token(i)
            if piece is None:
                raise PipelineError(where, f"token id {i} has no token (ids are not contiguous 0..{self.vocab_size - 1})",
                                    "use a tokenizer.json whose ids are contiguous")
            self._bytes.append(self._piece_bytes(i, piece))
        self._byte_id = [self.tok.token_to_id(p) for p in BYTE_PIECES]
        self.space_id = self.tok.token_to_id(SPACE)
        self._check_every_id()
        self.special_ids = sorted(i for i, a in self.added.items() if a.get("special"))
        self.settings = settings = settings or bpe.config_tokens(None, DEFAULTS)
        self.eos = bpe.resolve_token(self.tok, settings, "eos_token", where)
        self.bos = bpe.resolve_token(self.tok, settings, "bos_token", where)
        name = lambda i: None if i is None else self.tok.id_to_token(i)  # noqa: E731
        self.chat_description = bpe.describe_chat(name(self.bos), name(self.eos))
        self.card_eos = self.eos   # the card's usage snippet compares token ids with it

    def _piece_bytes(self, i: int, piece: str) -> bytes:
        if i in self.added:
            a = self.added[i]
            return b"" if a.get("special") else a["content"].replace(SPACE, " ").encode("utf-8")
        m = _BYTE.fullmatch(piece)
        return bytes([int(m[1], 16)]) if m else piece.replace(SPACE, " ").encode("utf-8")

    def _check_every_id(self) -> None:
        """Each id's bytes against the library's decoder: decoded after ``<0x41>`` ("A", so that the
        Strip of the dummy prefix leaves the id alone); the byte tokens 0x80..0xFF, which are no
        text alone, by their spelling."""
        anchor = self._byte_id[0x41]
        byte_ids = set(self._byte_id[0x80:])
        for p, i in zip(BYTE_PIECES, self._byte_id):
            if i in self.added or self._bytes[i] != bytes([int(p[3:5], 16)]):
                raise PipelineError(self.where, f"byte token {p} (id {i}) is an added token, not the model's byte",
                                    "use the checkpoint's own tokenizer.json")
        alone = self.tok.decode([anchor], skip_special_tokens=True)
        if alone != "A":
            raise PipelineError(self.where, f"its decoder gives {alone[:40]!r} for the byte token <0x41>, not 'A'",
                                "use a Llama/Mistral tokenizer.json (decoder Replace('▁', ' '), ByteFallback, Fuse, "
                                "Strip)")
        ids = [i for i in range(self.vocab_size) if i not in byte_ids]
        got = self.tok.decode_batch([[anchor, i] for i in ids], skip_special_tokens=True)
        for i, text in zip(ids, got):
            want = b"A" + self._bytes[i]
            if text.encode("utf-8") != want:
                raise PipelineError(self.where, f"token {i} {self.tok.id_to_token(i)[:40]!r} decodes to "
                                    f"{text.encode('utf-8')[1:41]!r} through its decoder, but the sp-bpe rule gives "
                                    f"{want[1:41]!r}", "use a Llama/Mistral tokenizer.json (decoder Replace('▁', ' '), "
                                    "ByteFallback, Fuse, Strip)")

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def n_ids(self) -> int:
        """How many ids it can produce (0 .. n_ids - 1, contiguous: checked on load)."""
        return self.vocab_size

    def prompt(self, text: str, chat: bool = True) -> list[int]:
        """``bos_token`` (``<s>``) first, then the chat-formatted prompt or the raw text."""
        head = [] if self.bos is None else [self.bos]
        return head + self.encode(CHAT.format(prompt=text) if chat else text)

    # --- encode / decode -----------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """SentencePiece's encoding of a whole text (the dummy prefix first)."""
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def encode_bytes(self, data: bytes) -> list[int]:
        """Any bytes: the first valid UTF-8 run as :meth:`encode` does (the dummy prefix; data that
        starts with an invalid byte gets the ``▁`` token first), later runs without it, each invalid
        byte its ``<0xNN>`` token. Valid UTF-8: the ids of :meth:`encode`."""
        ids: list[int] = []
        for k, (run, valid) in enumerate(bpe._utf8_runs(data)):
            if valid:
                tok = self.tok if k == 0 else self._cont
                ids.extend(tok.encode(run.decode("utf-8"), add_special_tokens=False).ids)
            else:
                ids.extend(([self.space_id] if k == 0 else []) + [self._byte_id[b] for b in run])
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The id's bytes as they are (``▁`` a space; nothing stripped: what a stream joins)."""
        return self._bytes[int(token_id)]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """A whole text from its start: the ids' bytes joined, less a first space (the dummy prefix)."""
        raw = b"".join(self._bytes[int(i)] for i in ids)
        return raw[1:] if raw[:1] == b" " else raw

    def table(self) -> dict[int, bytes]:
        """Every id's bytes (what a device-side detokeniser needs)."""
        return dict(enumerate(self._bytes))

    def check_round_trip(self, corpus: Iterable[str | bytes] = CHECK_CORPUS) -> int:
        """Byte-exact decode(encode(x)) for every entry (str or bytes), through :meth:`decode_bytes`
        and (str) the library's decoder; returns the tokens used. A failure is one line."""
        n = 0
        for k, item in enumerate(corpus):
            raw = item.encode("utf-8") if isinstance(item, str) else item
            ids = self.encode(item) if isinstance(item, str) else self.encode_bytes(item)
            got = self.decode_bytes(ids)
            if got != raw:
                at = next((i for i, (a, b) in enumerate(zip(got, raw)) if a != b), min(len(got), len(raw)))
                raise PipelineError(self.where, f"does not round-trip check string {k} ({raw[:30]!r}...): decoded bytes "
                                    f"differ from byte {at} on", "use the checkpoint's own Llama/Mistral tokenizer.json")
            if isinstance(item, str) and self.tok.decode(ids, skip_special_tokens=True) != item:
                raise PipelineError(self.where, f"its own decoder does not return check string {k} ({item[:30]!r}...)",
                                    "use a tokenizer.json with the SentencePiece decoder (Replace('▁', ' '), "
                                    "ByteFallback, Fuse, Strip)")
            n += len(ids)
        return n


def from_json(text: str, where: str | Path = "tokenizer.json", sha256: str | None = None,
              corpus: Iterable[str | bytes] = CHECK_CORPUS, settings: Mapping | None = None) -> SPBPETokenizer:
    """A verified tokenizer from tokenizer.json text; ``settings`` (bpe.config_tokens): by default
    the kind's defaults (:func:`load_file` reads the tokenizer_config.json beside the file)."""
    tok = SPBPETokenizer(text, where, settings)
    if sha256 is not None and tok.sha256 != sha256:
        raise PipelineError(where, f"sha256 is {tok.sha256}, expected {sha256}",
                            "download the pinned tokenizer.json again or fix models.<name>.source.tokenizer_sha256 "
                            "in config.yaml")
    tok.check_round_trip(corpus)
    return tok


def load_file(path: str | Path, sha256: str | None = None) -> SPBPETokenizer:
    """A tokenizer.json from disk, verified (the module doc), with the settings of the
    tokenizer_config.json beside it."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(path, "tokenizer.json is missing", "put the checkpoint's tokenizer.json beside its weights")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PipelineError(path, f"is not UTF-8 (byte {exc.start})", "download tokenizer.json again") from None
    return from_json(text, path, sha256, settings=bpe.config_tokens(path.parent / CONFIG_FILE, DEFAULTS))


# --- the synthetic tokenizer -----------------------------------------------------------------
def synthetic_alphabet(lines: list[str], size: int) -> list[str]:
    """The ``size`` most frequent characters of ``lines`` as SentencePiece sees them (a ``▁``
    before each line, spaces as ``▁``), ties by code point; sorted."""
    count = collections.Counter(ch for line in lines for ch in SPACE + line.replace(" ", SPACE))
    return sorted(sorted(count, key=lambda ch: (-count[ch], ch))[:size])


def synthetic_tokenizer_json(vocab_size: int = SYNTHETIC_VOCAB_SIZE) -> str:
    """tokenizer.json text of the synthetic SentencePiece-style BPE (deterministic: the module
    doc). Its vocabulary has exactly ``vocab_size`` ids (3 specials + 256 bytes + alphabet + merges)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    fixed = 3 + len(BYTE_PIECES)
    if vocab_size < fixed + 2:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for an alphabet after the {fixed} special and byte "
                         f"tokens: choose at least {fixed + 2}")
    lines = sorted(bpe.SYNTHETIC_CORPUS.splitlines(keepends=True))
    alphabet = synthetic_alphabet(lines, (vocab_size - fixed) // 2)
    tok = Tokenizer(models.BPE(unk_token=UNK, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    # initial_alphabet counts as infinitely frequent, so a limit of its size drops exactly the rest
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  special_tokens=[UNK, BOS, EOS, *BYTE_PIECES], initial_alphabet=alphabet,
                                  limit_alphabet=len(alphabet))
    with bpe._one_thread():
        tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise ValueError(f"the synthetic corpus yields {got} tokens, not {vocab_size}: choose a smaller vocab_size")
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [a for a in spec["added_tokens"] if a["content"] in (UNK, BOS, EOS)]  # bytes: model vocab
    spec.update(normalizer=None, decoder=DECODER,
                pre_tokenizer={"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "first", "split": False})
    return json.dumps(spec, ensure_ascii=False, sort_keys=True, indent=1) + "\n"


def synthetic(vocab_size: int = SYNTHETIC_VOCAB_SIZE) -> SPBPETokenizer:
    return from_json(synthetic_tokenizer_json(vocab_size), "synthetic tokenizer.json")


# --- the kind interface (tokenizers/__init__.py) ------------------------------------------------
def tsv_text(tok: SPBPETokenizer) -> str:
    return "".join(f"{i}\t{base64.b64encode(raw).decode('ascii')}\n" for i, raw in tok.table().items())


def load(vocab_dir: Path) -> SPBPETokenizer:
    """The tokenizer over a vocab stage output (its tokenizer.json verified again, its settings)."""
    return load_file(Path(vocab_dir) / TOKENIZER_FILE)


def source_files(out: Path, settings: Mapping) -> None:
    """A synthetic source's tokenizer files: the synthetic tokenizer.json and a tokenizer_config.json
    (Llama's tokens). ``vocab_size`` (the model's vocabulary) caps it: a larger model (a real
    shape, 32000) gets the 1024-token tokenizer, whose ids all have a row."""
    text = synthetic_tokenizer_json(min(int(settings.get("vocab_size", SYNTHETIC_VOCAB_SIZE)), SYNTHETIC_VOCAB_SIZE))
    (Path(out) / TOKENIZER_FILE).write_bytes(text.encode("utf-8"))
    (Path(out) / CONFIG_FILE).write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
        "add_bos_token": True, "add_eos_token": False, "legacy": False}, indent=2, sort_keys=True) + "\n")


def carry(base: Path, out: Path, settings: Mapping) -> list[Path]:
    """A checkpoint's tokenizer files, verified by this kind (bpe.carry_checked)."""
    return bpe.carry_checked(load_file, base, out, settings)


def fits(source_dir: Path, settings: Mapping, rows: Mapping[str, int], where: str | Path) -> int:
    """Every id has a row in the model (bpe.fits_checked, this kind's loader)."""
    return bpe.fits_checked(load_file, source_dir, settings, rows, where)


def bake_stage(source_dir: Path, out_dir: Path, settings: Mapping) -> dict:
    """The vocab stage for this kind: the source's tokenizer.json (its pin was checked by the source
    stage, whose manifest seals the bytes) verified again (the module doc) and written to
    ``out_dir`` with the device table ``spbpe_vocab.tsv`` (and tokenizer_config.json where it sets a
    token other than the defaults: bpe.write_vocab)."""
    del settings
    tok = load_file(Path(source_dir) / TOKENIZER_FILE)
    checked = tok.check_round_trip()
    files = bpe.write_vocab(out_dir, tok, DEVICE_FILE, tsv_text(tok), DEFAULTS)
    return {"entries": tok.vocab_size, "sha256": tok.sha256, "corpus": len(CHECK_CORPUS), "corpus_tokens": checked,
            "files": files,
            "summary": (f"{tok.vocab_size} tokens (sha256 {tok.sha256[:12]}) written with {DEVICE_FILE}; "
                        f"corpus of {len(CHECK_CORPUS)} round-tripped byte-exactly")}
