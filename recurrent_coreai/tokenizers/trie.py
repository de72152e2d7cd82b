"""The World tokenizer: greedy longest match over a byte trie.

Built from ``{id: bytes}``; it knows nothing about where the vocabulary came from, so
the same class serves the original vocab file and the baked TSV.
"""

from __future__ import annotations

from typing import Iterable, Mapping

_ID = -1  # key under which a trie node stores the token id that ends there


class TrieTokenizer:
    def __init__(self, vocab: Mapping[int, bytes]):
        self.vocab = dict(vocab)
        self.root: dict = {}
        for token_id, raw in self.vocab.items():
            node = self.root
            for byte in raw:
                node = node.setdefault(byte, {})
            node[_ID] = token_id

    def encode(self, text: str | bytes) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids: list[int] = []
        pos, n = 0, len(data)
        root = self.root
        while pos < n:
            node, best, end, j = root, None, pos, pos
            while j < n:
                node = node.get(data[j])
                if node is None:
                    break
                j += 1
                if _ID in node:
                    best, end = node[_ID], j
            if best is None:
                raise ValueError(f"byte 0x{data[pos]:02x} at offset {pos} has no token")
            ids.append(best)
            pos = end
        return ids

    def decode(self, ids: Iterable[int]) -> bytes:
        """Bytes of the ids; id 0 (end of text) decodes to nothing."""
        return b"".join(self.vocab[i] for i in ids if i != 0)
