"""The ``world`` tokenizer kind (RWKV-7, RWKV-6): the RWKV World vocabulary, found in its pinned PyPI
package, verified, baked to the device TSV, and the chat format that goes with it.

Original format (``rwkv_vocab_v20230424.txt``): ``<id> <python str/bytes literal> <byte length>``.
Baked format (``rwkv_vocab.tsv``): ``<id>\\t<base64(bytes)>\\n``, ids ascending.
"""

from __future__ import annotations

import ast
import base64
import binascii
import importlib.metadata
import itertools
from pathlib import Path
from typing import Iterator, Mapping

from recurrent_coreai.tokenizers import PIN, fit, round_trip
from recurrent_coreai.tokenizers.trie import TrieTokenizer
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import atomic_path, sha256_file

VOCAB_FILE = "rwkv_vocab_v20230424.txt"  # the World vocab file as checkpoints (and the pinned package) name it

WORLD_VOCAB_SIZE = 65529
ID_COUNT = WORLD_VOCAB_SIZE + 1  # ids 0 (end of text) .. 65529: a model needs a row for each
MIN_VOCAB = ID_COUNT  # the smallest synthetic shape.vocab the World ids fit in (config check)

# Strings the bake must round-trip through both tokenizers: the shared texts, then bytes that are
# not UTF-8.
CHECK_CORPUS: tuple[bytes, ...] = tuple(s.encode("utf-8") for s in round_trip.TEXTS) + (
    b"\xff\xfe invalid \x80\x81 utf-8 \xc3 \xed\xa0\x80 end",
    bytes(range(256)),
)


# --- the original vocab file, from its pinned package ------------------------------------
def package_vocab(package: str, version: str, filename: str, sha256: str) -> Path:
    """Path of the vocab file inside the installed, pinned package, verified by sha256."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise PipelineError(f"package {package}", "is not installed",
                            f"pip install {package}=={version} (or run `make setup`)") from None
    if dist.version != version:
        raise PipelineError(f"package {package}", f"version {dist.version} is installed, config pins {version}",
                            f"pip install {package}=={version}")
    matches = [f for f in (dist.files or []) if Path(str(f)).name == filename]
    if not matches:
        raise PipelineError(f"package {package}=={version}", f"has no file {filename}",
                            "fix vocab.file in config.yaml")
    path = Path(dist.locate_file(matches[0]))
    check_sha256(path, sha256)
    return path


def check_sha256(path: Path, sha256: str) -> None:
    if not path.is_file():
        raise PipelineError(path, "vocab file is missing", "reinstall the vocab package (make setup)")
    got = sha256_file(path)
    if got != sha256:
        raise PipelineError(path, f"sha256 is {got}, expected {sha256}",
                            "reinstall the pinned vocab package or fix vocab.sha256 in config.yaml")


VOCAB_FIX = "use the original rwkv_vocab_v20230424.txt (this copy is damaged)"


def _vocab_line(where: str, data: bytes) -> tuple[int, bytes] | None:
    """(token id, token bytes) of one line of the original format (None for a blank line); a
    malformed line is a PipelineError naming ``where`` (file:line) and what is wrong with it."""
    try:
        line = data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        raise PipelineError(where, f"is not UTF-8 (byte {exc.start} of the line is {data[exc.start]:#04x})",
                            VOCAB_FIX) from None
    if not line:
        return None
    first, last = line.find(" "), line.rfind(" ")
    if first <= 0 or first == last:
        raise PipelineError(where, f"is not '<id> <literal> <byte length>': {line[:60]!r}", VOCAB_FIX)
    sid, text, slen = line[:first], line[first + 1:last], line[last + 1:]
    if not sid.isdecimal():
        raise PipelineError(where, f"token id {sid[:20]!r} is not a number", VOCAB_FIX)
    try:
        literal = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        why = exc.msg if isinstance(exc, SyntaxError) else f"{type(exc).__name__}: {exc}"
        raise PipelineError(where, f"token {sid}: {text[:60]} is not a Python str/bytes literal ({why})",
                            VOCAB_FIX) from None
    if not isinstance(literal, (str, bytes)):
        raise PipelineError(where, f"token {sid}: {text[:60]} is not a str/bytes literal ({type(literal).__name__})",
                            VOCAB_FIX)
    raw = literal.encode("utf-8") if isinstance(literal, str) else literal
    if not slen.isdecimal() or len(raw) != int(slen):
        raise PipelineError(where, f"token {sid}: {text[:60]} is {len(raw)} bytes, the line says {slen[:20]!r}",
                            VOCAB_FIX)
    return int(sid), raw


def _vocab_lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(line number, token id, token bytes) of every entry of a vocab file."""
    with open(path, "rb") as fh:
        for lineno, data in enumerate(fh, 1):
            entry = _vocab_line(f"{path}:{lineno}", data)
            if entry is not None:
                yield lineno, *entry


def parse_world_vocab(path: Path) -> dict[int, bytes]:
    vocab: dict[int, bytes] = {}
    first_line: dict[int, int] = {}
    for lineno, token_id, raw in _vocab_lines(path):
        if token_id in vocab:
            raise PipelineError(f"{path}:{lineno}", f"token id {token_id} repeats line {first_line[token_id]}",
                                VOCAB_FIX)
        vocab[token_id], first_line[token_id] = raw, lineno
    return vocab


def check_checkpoint_vocab(shipped: Path, pinned: Path) -> None:
    """A checkpoint's own vocab file must hold the World vocab of (sha256-verified) ``pinned``,
    line by line; other line ends are fine. Only lines whose bytes differ are parsed: a damaged
    line is named by its number and what is malformed, another tokenizer by its first token."""
    if sha256_file(shipped) == sha256_file(pinned):
        return
    with open(shipped, "rb") as theirs_fh, open(pinned, "rb") as ours_fh:
        for lineno, (data, world) in enumerate(itertools.zip_longest(theirs_fh, ours_fh, fillvalue=b""), 1):
            if data.rstrip(b"\r\n") == world.rstrip(b"\r\n"):
                continue
            where = f"{shipped}:{lineno}"
            theirs, ours = _vocab_line(where, data), _vocab_line(f"{pinned}:{lineno}", world)
            if theirs == ours:
                continue  # the same token written another way
            if theirs is None:
                raise PipelineError(where, f"ends where the World vocab has token {ours[0]}", VOCAB_FIX)
            if ours is None:
                what = f"token {theirs[0]} is beyond the World vocab's {WORLD_VOCAB_SIZE} tokens"
            elif theirs[0] == ours[0]:
                what = f"token {theirs[0]} is {theirs[1]!r}, World has {ours[1]!r}"
            else:
                what = f"holds token {theirs[0]} where the World vocab has token {ours[0]}"
            raise PipelineError(where, f"{what}: not the World vocab",
                                "this model does not use the RWKV World tokenizer; it is not supported")


# --- the baked TSV -------------------------------------------------------------------------
def tsv_text(vocab: Mapping[int, bytes]) -> str:
    return "".join(f"{i}\t{base64.b64encode(vocab[i]).decode('ascii')}\n" for i in sorted(vocab))


def read_tsv(path: Path) -> dict[int, bytes]:
    vocab: dict[int, bytes] = {}
    data = path.read_bytes()
    if b"\r" in data:
        raise PipelineError(path, "contains CR characters", "the TSV must use LF line ends; re-bake it")
    last = 0
    for lineno, line in enumerate(data.decode("ascii").split("\n")[:-1], 1):
        try:
            sid, b64 = line.split("\t")
            token_id = int(sid)
            vocab[token_id] = base64.b64decode(b64, validate=True)
        except (ValueError, binascii.Error) as exc:
            raise PipelineError(f"{path}:{lineno}", f"bad line ({exc})", "re-bake the TSV") from None
        if token_id <= last:
            raise PipelineError(f"{path}:{lineno}", f"id {token_id} is not ascending", "re-bake the TSV")
        last = token_id
    return vocab


def verify_bake(original: Mapping[int, bytes], tsv_path: Path, corpus=CHECK_CORPUS,
                official=None) -> dict:
    """Check (a) every TSV entry decodes to its exact original bytes and (b) a trie tokenizer
    over the TSV encodes the corpus like the one over the original file (and like the official
    tokenizer, when given) and decodes back byte-exactly. Returns counts for the log."""
    baked = read_tsv(tsv_path)
    if len(baked) != len(original) or sorted(baked) != sorted(original):
        raise PipelineError(tsv_path, f"has {len(baked)} entries, the original has {len(original)}", "re-bake the TSV")
    for token_id, raw in original.items():
        if baked[token_id] != raw:
            raise PipelineError(tsv_path, f"token {token_id} decodes to {baked[token_id]!r}, expected {raw!r}",
                                "re-bake the TSV")
    ours, theirs = TrieTokenizer(baked), TrieTokenizer(original)
    checked_official = 0
    for text in corpus:
        ids = ours.encode(text)
        if ids != theirs.encode(text):
            raise PipelineError(tsv_path, f"encodes {text[:40]!r} differently from the original vocab", "re-bake the TSV")
        if ours.decode(ids) != text:
            raise PipelineError(tsv_path, f"does not round-trip {text[:40]!r}", "re-bake the TSV")
        if official is not None:
            try:
                as_str = text.decode("utf-8")
            except UnicodeDecodeError:
                continue  # the official tokenizers take str only
            if official.encode(as_str) != ids:
                raise PipelineError(tsv_path, f"encodes {text[:40]!r} differently from the official tokenizer",
                                    "re-bake the TSV")
            checked_official += 1
    return {"entries": len(baked), "corpus": len(corpus), "checked_official": checked_official}


def bake(original_path: Path, out: Path, official=None) -> dict:
    original = parse_world_vocab(original_path)
    if len(original) != WORLD_VOCAB_SIZE:
        raise PipelineError(original_path, f"has {len(original)} tokens, expected {WORLD_VOCAB_SIZE}",
                            "use the World vocab rwkv_vocab_v20230424.txt")
    with atomic_path(out) as tmp:
        tmp.write_bytes(tsv_text(original).encode("ascii"))
        report = verify_bake(original, tmp, official=official)
    return report


# --- the tokenizer kind: what stages and tools use ------------------------------------------
DEVICE_FILE = "rwkv_vocab.tsv"  # the device vocab, published beside every compiled bundle
EOS = 0  # end of text; also the token every prompt starts with
CHAT = "User: {prompt}\n\nAssistant:"
DESCRIPTION = f"RWKV World, greedy longest match over {DEVICE_FILE} (id TAB base64 bytes)"
CHAT_DESCRIPTION = "token 0, then 'User: {prompt}\\n\\nAssistant:'; end of text = token 0"
# files of a checkpoint the source stage carries over besides the weights
CARRY = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", VOCAB_FILE)


class WorldTokenizer:
    """Encode text, the bytes of a token, and the chat prompt (token 0 first)."""

    eos = EOS

    def __init__(self, vocab: Mapping[int, bytes]):
        self.trie = TrieTokenizer(vocab)

    def __len__(self) -> int:
        return len(self.trie.vocab)

    @property
    def n_ids(self) -> int:
        """How many ids it can produce: 0 (end of text) .. the highest id of its vocabulary."""
        return max(self.trie.vocab, default=EOS) + 1

    def encode(self, text: str | bytes) -> list[int]:
        return self.trie.encode(text)

    def token_bytes(self, token: int) -> bytes:
        return b"" if token == EOS else self.trie.vocab[token]

    def prompt(self, text: str, chat: bool = True) -> list[int]:
        """Token 0, then the chat-formatted prompt (``chat``) or the raw text."""
        return [EOS] + self.encode(CHAT.format(prompt=text) if chat else text)


def load(vocab_dir: Path) -> WorldTokenizer:
    """The tokenizer over a vocab stage output (``results/<m>/vocab/``)."""
    path = Path(vocab_dir) / DEVICE_FILE
    if not path.is_file():
        raise PipelineError(path, "missing", "run the vocab stage (snakemake --forcerun vocab)")
    return WorldTokenizer(read_tsv(path))


def pinned(settings: Mapping) -> Path:
    """The World vocab file of the pinned package (config.yaml ``vocab:``), verified."""
    return package_vocab(settings["package"], settings["version"], settings["file"], settings["sha256"])


def source_files(out: Path, settings: Mapping) -> None:
    """A synthetic source's tokenizer files: the pinned vocab and a tokenizer_config.json."""
    import json
    import shutil

    shutil.copyfile(pinned(settings), out / VOCAB_FILE)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "RwkvTokenizer", "vocab_file": VOCAB_FILE, "bos_token": "<s>", "eos_token": "<s>",
        "model_max_length": 1000000000000000019884624838656}, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def carry(base: Path, out: Path, settings: Mapping) -> list[Path]:
    """Copy a checkpoint's tokenizer files into ``out`` (its vocab checked against the pinned one,
    whose bytes are kept); returns the files read."""
    import shutil

    carried = [base / name for name in CARRY if (base / name).is_file()]
    for f in carried:
        if f.name == VOCAB_FILE:
            check_checkpoint_vocab(f, pinned(settings))
            shutil.copyfile(pinned(settings), out / VOCAB_FILE)  # the same tokens; keep the pinned bytes
        else:
            shutil.copyfile(f, out / f.name)
    return carried


def fits(source_dir: Path, settings: Mapping, rows: Mapping[str, int], where: str | Path) -> int:
    """Every World id (0 .. 65529; the vocabulary is pinned) has a row in each tensor of ``rows``
    ({tensor: rows}); else one line at ``where``. Returns the number of ids."""
    del source_dir  # the pinned vocabulary; a checkpoint's own copy is checked against it (carry)
    if settings.get(PIN):
        raise PipelineError("config.yaml", f"source.{PIN} pins a tokenizer file, but this model uses the RWKV World "
                            "vocabulary, pinned by vocab.sha256", f"remove {PIN} from the model's source")
    fit.check(where, rows, ID_COUNT, "the RWKV World vocabulary",
              "this checkpoint was not trained with the RWKV World vocabulary (every token id needs a row in the "
              "embedding and the head): set models.<m>.tokenizer to the kind it was trained with (bytes for a "
              "byte-level model: 256 ids)")
    return ID_COUNT


def bake_stage(source_dir: Path, out_dir: Path, settings: Mapping) -> dict:
    """The vocab stage for this kind: bake the pinned World vocab to ``out_dir/rwkv_vocab.tsv`` and
    verify it (a checkpoint's own vocab must be the World vocab)."""
    import pyrwkv_tokenizer

    original = pinned(settings)
    shipped = Path(source_dir) / VOCAB_FILE
    if shipped.is_file():
        check_checkpoint_vocab(shipped, original)
    with atomic_path(out_dir, directory=True) as tmp:
        report = bake(original, tmp / DEVICE_FILE, official=pyrwkv_tokenizer.RWKVTokenizer())
    return {**report, "files": [DEVICE_FILE],
            "summary": (f"{report['entries']} entries baked to {DEVICE_FILE}; corpus of {report['corpus']} checked "
                        f"({report['checked_official']} also against pyrwkv_tokenizer)")}
