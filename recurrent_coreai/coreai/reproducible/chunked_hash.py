"""``main.hash`` without a second copy of ``main.mlirb``: ``save_asset`` hashes the file it just
wrote after reading it whole into one ``bytes`` (a second copy of the bundle while the IR is
still alive). Within :func:`~recurrent_coreai.coreai.reproducible.export_scope`, ``read_bytes`` of
that file gives an :class:`Unread` and the ``hashlib`` coreai sees is :class:`ChunkedHashlib`,
which hashes the file in chunks instead (the same digest)."""

from __future__ import annotations

import hashlib
from pathlib import Path

HASH_CHUNK = 16 << 20


class Unread:
    """What ``read_bytes`` gives back for a ``main.mlirb`` written within ``export_scope``:
    the file, unread, which :class:`ChunkedHashlib` hashes in chunks."""

    def __init__(self, path: Path):
        self.path = path


class ChunkedHashlib:
    """``hashlib`` as ``coreai.authoring.asset`` sees it within ``export_scope``."""

    def __getattr__(self, name: str):
        return getattr(hashlib, name)

    @staticmethod
    def sha256(data=b""):
        if not isinstance(data, Unread):
            return hashlib.sha256(data)
        digest = hashlib.sha256()
        with open(data.path, "rb") as fh:
            while chunk := fh.read(HASH_CHUNK):
                digest.update(chunk)
        return digest
