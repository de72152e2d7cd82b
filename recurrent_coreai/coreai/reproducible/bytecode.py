"""MLIR bytecode: canonical ``resource_<n>`` weight-blob names.

The names are made in native ``create_elements_attr`` from a hash seeded by a load address
(ASLR). They only exist as keys in the bytecode's string section, so
:func:`canonicalize_resource_names` renames them ``resource_0, resource_1, ...`` in the order of
the resource section, right after coreai writes ``main.mlirb`` and before it hashes it into
``main.hash``. No address tricks: the names no longer depend on the host. The layout parsed here
is bytecode version 6 (an assumption checked in :mod:`.patches`)."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

MAGIC = b"ML\xefR"
SECTION_STRING, SECTION_RESOURCE_OFFSET = 0, 6
ALIGNMENT_BYTE = 0xCB
RESOURCE_NAME = re.compile(rb"resource_\d+")


def _read_varint(buf: io.BufferedIOBase) -> int:
    """MLIR bytecode's PrefixVarInt: the first byte's trailing zeros say how many bytes follow."""
    first = buf.read(1)[0]
    if first == 0:
        return int.from_bytes(buf.read(8), "little")
    n = (first & -first).bit_length()
    return int.from_bytes(bytes([first]) + buf.read(n - 1), "little") >> n


def _varint(value: int) -> bytes:
    for n in range(1, 9):
        if value >> (7 * n) == 0:
            return (((value << 1) | 1) << (n - 1)).to_bytes(n, "little")
    return b"\0" + value.to_bytes(8, "little")


def sections(fh) -> list[dict]:
    """The sections of an open MLIR bytecode file: id, offset of the section header, data offset, size, alignment."""
    end, out = fh.seek(0, os.SEEK_END), []
    fh.seek(0)
    if fh.read(4) != MAGIC:
        raise ValueError("not MLIR bytecode")
    _read_varint(fh)  # bytecode version
    while fh.read(1) not in (b"\0", b""):  # producer string
        pass
    pos = fh.tell()
    while pos < end:
        code = fh.read(1)[0]
        size = _read_varint(fh)
        align = 1
        if code & 0x80:
            align = _read_varint(fh)
            while fh.tell() % align:
                if fh.read(1)[0] != ALIGNMENT_BYTE:
                    raise ValueError("bad section alignment padding")
        data = fh.tell()
        out.append({"id": code & 0x7F, "header": pos, "data": data, "size": size, "align": align})
        pos = fh.seek(data + size)
    if pos != end:
        raise ValueError("sections overrun the file")
    return out


def _emit_section(offset: int, sid: int, data: bytes, align: int) -> bytes:
    """A section as MLIR's writer emits it at ``offset`` (padding only when not aligned already)."""
    head = bytes([sid]) + _varint(len(data))
    if align > 1 and (offset + len(head)) % align:
        head = bytes([sid | 0x80]) + head[1:] + _varint(align)
        head += bytes([ALIGNMENT_BYTE]) * (-(offset + len(head)) % align)
    return head + data


def _parse_strings(data: bytes) -> list[bytes]:
    buf = io.BytesIO(data)
    sizes = [_read_varint(buf) for _ in range(_read_varint(buf))][::-1]
    strings = [buf.read(n) for n in sizes]
    if any(s[-1:] != b"\0" for s in strings) or buf.read():
        raise ValueError("malformed string section")
    return [s[:-1] for s in strings]


def _encode_strings(strings: list[bytes]) -> bytes:
    return (_varint(len(strings)) + b"".join(_varint(len(s) + 1) for s in reversed(strings))
            + b"".join(s + b"\0" for s in strings))


def _resource_keys(data: bytes) -> list[int]:
    """String indices of every resource key, in the order of the resource section."""
    buf, keys = io.BytesIO(data), []

    def group() -> None:
        _read_varint(buf)  # group key: a string (external groups) or a dialect number
        for _ in range(_read_varint(buf)):
            keys.append(_read_varint(buf))
            _read_varint(buf)  # size
            buf.read(1)  # kind
    for _ in range(_read_varint(buf)):
        group()
    while buf.tell() < len(data):
        group()
    return keys


def canonicalize_resource_names(path: Path) -> int:
    """Rename the ``resource_<n>`` blob keys of an MLIR bytecode file to ``resource_<i>`` (i in
    resource-section order), in place. Only the string section and what follows it are
    rewritten (the weights before it are not touched). Returns how many names changed."""
    with open(path, "r+b") as fh:
        secs = sections(fh)
        by_id = {s["id"]: s for s in secs}
        if len(by_id) != len(secs) or SECTION_STRING not in by_id or SECTION_RESOURCE_OFFSET not in by_id:
            raise ValueError("expected exactly one string and one resource-offset section")

        def data(sec: dict) -> bytes:
            fh.seek(sec["data"])
            return fh.read(sec["size"])

        strings_sec = by_id[SECTION_STRING]
        raw = data(strings_sec)
        strings = _parse_strings(raw)
        if _encode_strings(strings) != raw:
            raise ValueError("string section does not re-encode byte for byte")
        renamed: dict[int, bytes] = {}
        for key in _resource_keys(data(by_id[SECTION_RESOURCE_OFFSET])):
            if key not in renamed and RESOURCE_NAME.fullmatch(strings[key]):
                renamed[key] = b"resource_%d" % len(renamed)
        others = {s for i, s in enumerate(strings) if i not in renamed}
        if others & set(renamed.values()):
            raise ValueError("a canonical resource name is already used by another string")
        changed = sum(1 for i, name in renamed.items() if strings[i] != name)
        strings = [renamed.get(i, s) for i, s in enumerate(strings)]

        tail = [s for s in secs if s["header"] >= strings_sec["header"]]
        payload = {s["header"]: (_encode_strings(strings) if s is strings_sec else data(s)) for s in tail}
        offset = strings_sec["header"]
        fh.seek(offset)
        for sec in tail:
            chunk = _emit_section(offset, sec["id"], payload[sec["header"]], sec["align"])
            fh.write(chunk)
            offset += len(chunk)
        fh.truncate(offset)
    return changed
