"""Changes to a stage's output after its stage, as a careful, hostile user makes them: each writes a
new inode (a hard-linked copy never reaches the tree it was linked from) and keeps the file's times,
so only the bytes tell (tests/test_integrity.py, tests/test_report.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from recurrent_coreai.pipeline import records


def rewrite(path: Path, data: bytes) -> None:
    st = path.stat()
    path.unlink()  # a new inode: the copy's hard links (if any) never reach the shared tree
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    rewrite(path, bytes(data))


def json_edit(key: str, value):
    def change(path: Path) -> None:
        record = json.loads(path.read_text())
        assert key in record, (path, sorted(record))
        record[key] = value
        rewrite(path, json.dumps(record, indent=2, sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return change


def resealed_json_edit(key: str, value):
    """An edit that keeps the file canonical and (wrongly) keeps the old seal: still refused."""
    def change(path: Path) -> None:
        record = json.loads(path.read_text())
        record[key] = value
        rewrite(path, records.dumps_json(record).encode())
    return change


def swap_two_tokens(path: Path) -> None:
    """Two entries of the baked vocabulary swap their bytes (an app would decode wrongly)."""
    lines = path.read_bytes().split(b"\n")
    a, b = 300, 301
    ia, ib = lines[a].index(b"\t"), lines[b].index(b"\t")
    lines[a], lines[b] = lines[a][:ia] + lines[b][ib:], lines[b][:ib] + lines[a][ia:]
    rewrite(path, b"\n".join(lines))


def append_line(path: Path) -> None:
    rewrite(path, path.read_bytes() + b"maintainer note\n")
