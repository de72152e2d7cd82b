"""The texts every tokenizer kind must round-trip byte-exactly (decode of encode): several scripts,
astral-plane emoji and ZWJ sequences, NUL and other control bytes, CRLF, long whitespace runs and
code. Each kind's ``CHECK_CORPUS`` is these, then what only it is asked (the World kind: bytes that
are not UTF-8; the BPE kind: edge spaces and the printable ASCII run)."""

from __future__ import annotations

TEXTS: tuple[str, ...] = (
    "User: hi\n\nAssistant:",
    "The quick brown fox jumps over the lazy dog.",
    "日本語のテキストと中文文本，한국어 텍스트도 있습니다。",
    "Emoji: 😀🦢🏳️‍🌈👩🏽‍💻 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈",
    "NUL\x00inside\x00\x00and\x01\x02\x1f control",
    "line one\r\nline two\r\n\r\n",
    " " * 300 + "\t" * 40 + "\n" * 17,
    "def f(x):\n    return {'a': [1, 2, 3]}  # code\n",
    "Ελληνικά, русский, العربية, עברית, हिन्दी",
)
