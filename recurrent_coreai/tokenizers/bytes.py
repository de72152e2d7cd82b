"""The ``bytes`` tokenizer kind: byte-level models (a 256-token vocabulary, e.g. a BlinkDL ``.pth``
trained on raw bytes whose ``emb.weight`` has 256 rows). Id = byte value, 0 .. 255; nothing to
learn, nothing to read from the checkpoint.

* Encoding is ``list(text.encode("utf-8"))`` (bytes as they are); decoding joins the ids' bytes,
  so any bytes round-trip, invalid UTF-8 included. A character of several bytes spans several
  tokens: a stream joins bytes, not strings (``generate``'s TextStream holds an incomplete
  character back).
* No special tokens unless configured: the end-of-text id is the settings key ``tokenizer_eos``
  (``tokenizers.EOS_KEY``: config.yaml ``models.<m>.tokenizer_eos``, a byte value 0..255, or
  absent / null: none). With one, it is also the prompt's first token (a document boundary, as the
  World and BPE kinds start theirs) and a prompt holding that byte is refused (it would end the
  text inside the prompt); without one, generation stops by length or a stop string.
* The chat format: :data:`CHAT` (``User: {prompt}\\n\\nAssistant:``) as plain bytes.
* The vocab stage writes ``bytes_vocab.tsv`` (``<id>\\t<base64(bytes)>\\n``, ids 0..255 ascending,
  the World kind's format: id -> its one byte) and ``bytes_tokenizer.json`` (the end-of-text id,
  ``null`` for none, and the id count), each re-read and compared with what this module derives:
  a table that is not exactly the identity (two ids swapped, a byte changed, an id missing) is one
  line naming the first id that differs. :func:`load` checks the same again.

Shared layer: no family imports.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Mapping

from recurrent_coreai.tokenizers import EOS_KEY, PIN, fit, round_trip
from recurrent_coreai.tokenizers.world import tsv_text
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import atomic_path

N_IDS = 256                       # ids 0..255, one per byte value
MIN_VOCAB = N_IDS                 # a model needs a row for each (config check of a synthetic shape)
DEVICE_FILE = "bytes_vocab.tsv"   # id \t base64(the id's byte), ids 0..255 ascending
CONFIG_FILE = "bytes_tokenizer.json"  # {"eos": id or null, "n_ids": 256}: what a device app needs beside the table
EOS = None                        # the kind's default: no end-of-text token
CHAT = "User: {prompt}\n\nAssistant:"
DESCRIPTION = f"byte-level: 256 ids, id = byte value ({DEVICE_FILE}: id TAB base64 byte; {CONFIG_FILE}: end of text)"
CARRY: tuple[str, ...] = ()       # a byte-level checkpoint has no tokenizer files to carry
FIX = "re-run the vocab stage (snakemake --forcerun vocab): the byte-level table is id = byte value"
# the texts the vocab stage round-trips: the shared ones, bytes that are not UTF-8, every byte
CHECK_CORPUS: tuple[bytes, ...] = tuple(s.encode("utf-8") for s in round_trip.TEXTS) + (
    b"\xff\xfe invalid \x80\x81 utf-8 \xc3 \xed\xa0\x80 end",
    bytes(range(256)),
)


def describe_chat(eos: int | None) -> str:
    """The chat format for the card and the catalog, with this model's end of text."""
    if eos is None:
        return "the bytes of 'User: {prompt}\\n\\nAssistant:'; no end-of-text token (generation stops by length)"
    return f"token {eos}, then the bytes of 'User: {{prompt}}\\n\\nAssistant:'; end of text = token {eos}"


CHAT_DESCRIPTION = describe_chat(EOS)


def table() -> dict[int, bytes]:
    """The kind's table, derived: every id's bytes (its byte value)."""
    return {i: bytes([i]) for i in range(N_IDS)}


def check_eos(eos, where: str | Path = "config.yaml") -> int | None:
    """A configured end-of-text id: None, or a byte value 0..255 (an int, not a bool)."""
    if eos is None:
        return None
    if isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < N_IDS:
        raise PipelineError(where, f"{EOS_KEY} {eos!r} is not a byte value", "use an id 0..255 (the byte that ends a "
                            "text in the model's training data), or null for none")
    return eos


def config_text(eos: int | None) -> str:
    return json.dumps({"eos": eos, "n_ids": N_IDS}, indent=2, sort_keys=True) + "\n"


class BytesTokenizer:
    """Id = byte value; ``eos`` the configured end-of-text id (or None)."""

    n_ids = N_IDS

    def __init__(self, eos: int | None = None):
        self.eos = check_eos(eos)
        self.chat_description = describe_chat(self.eos)
        self.card_eos = self.eos   # the card's usage snippet compares token ids with it (None: never)

    def __len__(self) -> int:
        return N_IDS

    def encode(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else bytes(text))

    def token_bytes(self, token: int) -> bytes:
        token = int(token)
        if not 0 <= token < N_IDS:
            raise ValueError(f"token {token} is not a byte id (0..{N_IDS - 1})")
        return bytes([token])

    def decode_bytes(self, ids) -> bytes:
        return b"".join(self.token_bytes(i) for i in ids)

    def prompt(self, text: str, chat: bool = True) -> list[int]:
        """The end-of-text token first when one is configured, then the chat-formatted prompt
        (``chat``) or the raw text, as bytes. A prompt holding the end-of-text byte is a
        ValueError (it would end the text inside the prompt)."""
        ids = self.encode(CHAT.format(prompt=text) if chat else text)
        if self.eos is None:
            return ids
        if self.eos in ids:
            raise ValueError(f"the prompt holds byte {self.eos:#04x}, this model's end-of-text token")
        return [self.eos] + ids


# --- the device files, derived and verified ----------------------------------------------------------
def read_tsv(path: Path) -> dict[int, bytes]:
    """A device table (the World kind's format; ids from 0, ascending), each line checked."""
    data = path.read_bytes()
    if b"\r" in data or not data.endswith(b"\n"):
        raise PipelineError(path, "does not end its lines with LF only", FIX)
    vocab: dict[int, bytes] = {}
    for lineno, line in enumerate(data.split(b"\n")[:-1], 1):
        try:
            sid, b64 = line.decode("ascii").split("\t")
            token_id = int(sid)
            vocab[token_id] = base64.b64decode(b64, validate=True)
        except (ValueError, binascii.Error) as exc:
            raise PipelineError(f"{path}:{lineno}", f"bad line ({exc})", FIX) from None
        if token_id != lineno - 1:
            raise PipelineError(f"{path}:{lineno}", f"holds id {token_id} where id {lineno - 1} belongs (ids 0, 1, 2 "
                                "... in order)", FIX)
    return vocab


def verify_table(path: Path) -> int:
    """``path`` (a ``bytes_vocab.tsv``) holds exactly :func:`table`; else one line naming the
    first id that differs. Returns the entries."""
    got, want = read_tsv(path), table()
    for i in range(N_IDS):
        if i not in got:
            raise PipelineError(path, f"has no id {i} ({len(got)} entries; the byte-level table has ids 0..{N_IDS - 1})",
                                FIX)
        if got[i] != want[i]:
            raise PipelineError(path, f"id {i} is {got[i]!r}, the byte-level table has {want[i]!r} (id = byte value)",
                                FIX)
    extra = sorted(set(got) - set(want))
    if extra:
        raise PipelineError(path, f"has id {extra[0]}, beyond the byte-level table's ids 0..{N_IDS - 1}", FIX)
    return len(got)


def read_config(path: Path) -> int | None:
    """The end-of-text id a ``bytes_tokenizer.json`` states (checked)."""
    if not path.is_file():
        raise PipelineError(path, "missing", FIX)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise PipelineError(path, f"is not JSON ({exc})", FIX) from None
    if not isinstance(data, dict) or set(data) != {"eos", "n_ids"} or data["n_ids"] != N_IDS:
        raise PipelineError(path, f"is not {{'eos': id or null, 'n_ids': {N_IDS}}}: {str(data)[:80]}", FIX)
    return check_eos(data["eos"], path)


def verify_round_trip(tok: BytesTokenizer, where: Path, corpus=CHECK_CORPUS) -> int:
    """decode(encode(x)) == x byte-exactly, and encode(x) == list(x), for every entry."""
    for k, text in enumerate(corpus):
        ids = tok.encode(text)
        if ids != list(text) or tok.decode_bytes(ids) != text:
            raise PipelineError(where, f"does not round-trip check string {k} ({text[:30]!r})", FIX)
    return len(corpus)


# --- the tokenizer kind: what stages and tools use ------------------------------------------------------
def load(vocab_dir: Path) -> BytesTokenizer:
    """The tokenizer over a vocab stage output (``results/<m>/vocab/``), its table verified."""
    path = Path(vocab_dir) / DEVICE_FILE
    if not path.is_file():
        raise PipelineError(path, "missing", "run the vocab stage (snakemake --forcerun vocab)")
    verify_table(path)
    return BytesTokenizer(read_config(Path(vocab_dir) / CONFIG_FILE))


def _no_pin(settings: Mapping) -> None:
    if settings.get(PIN):
        raise PipelineError("config.yaml", f"source.{PIN} pins a tokenizer file, but this model uses the byte-level "
                            "tokenizer (models.<m>.tokenizer: bytes), which reads none", f"remove {PIN} from the "
                            "model's source")


def source_files(out: Path, settings: Mapping) -> None:
    """A synthetic source's tokenizer files: none (the table is fixed; the end of text is a setting)."""
    del out
    _no_pin(settings)


def carry(base: Path, out: Path, settings: Mapping) -> list[Path]:
    """A checkpoint's tokenizer files: none are read or carried (the byte-level table is fixed)."""
    del base, out
    _no_pin(settings)
    return []


def fits(source_dir: Path, settings: Mapping, rows: Mapping[str, int], where: str | Path) -> int:
    """Every byte id (0 .. 255) has a row in each tensor of ``rows`` ({tensor: rows}); else one
    line at ``where``. Returns the number of ids."""
    del source_dir
    _no_pin(settings)
    check_eos(settings.get(EOS_KEY))
    fit.check(where, rows, N_IDS, "the byte-level tokenizer (models.<m>.tokenizer: bytes)",
              "a byte-level model has a row for each of the 256 byte values (every token id needs a row in the "
              "embedding and the head); set models.<m>.tokenizer to the tokenizer this checkpoint was trained with")
    return N_IDS


def bake_stage(source_dir: Path, out_dir: Path, settings: Mapping) -> dict:
    """The vocab stage for this kind: ``bytes_vocab.tsv`` and ``bytes_tokenizer.json`` written from
    the derived table and the configured end of text, then read back and compared with them."""
    del source_dir
    eos = check_eos(settings.get(EOS_KEY))
    with atomic_path(out_dir, directory=True) as tmp:
        (tmp / DEVICE_FILE).write_bytes(tsv_text(table()).encode("ascii"))
        (tmp / CONFIG_FILE).write_text(config_text(eos), encoding="utf-8")
        entries = verify_table(tmp / DEVICE_FILE)
        if read_config(tmp / CONFIG_FILE) != eos:
            raise PipelineError(tmp / CONFIG_FILE, "does not state the configured end of text", FIX)
        checked = verify_round_trip(load(tmp), tmp / DEVICE_FILE)
    eos_text = "no end-of-text token" if eos is None else f"end of text = id {eos}"
    return {"entries": entries, "eos": eos, "corpus": checked, "files": [DEVICE_FILE, CONFIG_FILE],
            "summary": (f"{entries} byte ids written to {DEVICE_FILE} and checked against the derived table; "
                        f"{eos_text} ({CONFIG_FILE}); corpus of {checked} round-tripped byte-exactly")}
