"""Byte-reproducible Core AI exports and universal lowerings (coreai-core 1.0.0b3).

Every patch of coreai-* internals lives here, scoped by a context manager and undone on exit.
What made two builds of identical weights differ, and what removes it:

* op-name suffixes (``layer_norm_ppcmsyzh``): ``secrets.choice`` imported as ``choice`` into
  ``coreai.authoring.{graph_builder,func,metal}``; the ``secrets.randbits(64)`` default of
  ``record_id`` in ``coreai._compiler.dialects.debuginfo.ops.record``; ``uuid4`` in
  ``coreai_torch.externalize``. Within :func:`export_scope` they draw from a ``random.Random``
  seeded from the bundle's name (str seeds are hashed with SHA-512, not ``hash()``, so
  PYTHONHASHSEED does not matter).
* ``resource_<n>`` weight-blob names: made in native ``create_elements_attr`` from a hash seeded
  by a load address (ASLR). They only exist as keys in the MLIR bytecode's string section, so
  :func:`canonicalize_resource_names` renames them ``resource_0, resource_1, ...`` in the order
  of the resource section, right after coreai writes ``main.mlirb`` and before it hashes it into
  ``main.hash``. No address tricks: the names no longer depend on the host.
* ``metadata.json`` key order: a Swift dictionary, hashed with a per-process seed unless
  ``SWIFT_DETERMINISTIC_HASHING=1`` is in the environment when ``libswiftCore`` loads (its global
  constructor reads it). Importing this module (and ``recurrent_coreai``) sets it;
  :func:`swift_hashing_deterministic` reads the flag from the loaded runtime itself.
* the universal ``.odix``: the register resets (``odix.load_imm %r {imm = 0 : i64}``) that end
  each ``odix.region`` come out of native ``compile_to_binary`` in heap-address order. Within
  :func:`lowering_scope` :func:`canonicalize_register_resets` gives them their registers in
  definition order before ``serialize_module`` writes the file (a set of independent resets to
  zero; the ops themselves stay where they are, each carries a positional op id).
  With more than one function (``main`` + ``prefill``), the file's function table (a FlatBuffers
  vector of ``{name, indices}`` tables) also comes out in either order;
  :func:`canonicalize_function_table` moves the tables so that the vector is in name order, which
  is byte for byte what coreai writes when it happens to pick that order.

Memory, not bytes: ``save_asset`` hashes ``main.mlirb`` into ``main.hash`` after reading the whole
file into one ``bytes`` (a second copy of the bundle while the IR is still alive); within
:func:`export_scope` the file it reads back is hashed in chunks instead (same digest).
:func:`constants_released` lets a conversion free each weight's torch storage
as soon as coreai-torch has copied it into a constant (the bundle does not change; see there).

``tests/test_reproducible.py`` checks every assumption listed in :data:`ASSUMPTIONS` against the
installed coreai and fails with its text when an upgrade breaks one.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import importlib.util
import inspect
import io
import logging
import os
import pathlib
import random
import re
import uuid
from pathlib import Path
from typing import Callable, Iterator

from recurrent_coreai.util.errors import PipelineError

SWIFT_HASHING_ENV = "SWIFT_DETERMINISTIC_HASHING"  # set by recurrent_coreai/__init__.py, before coreai loads
os.environ.setdefault(SWIFT_HASHING_ENV, "1")  # effective only if libswiftCore is not loaded yet

log = logging.getLogger(__name__)

ASSET = "coreai.authoring.asset"
CHOICE_SITES = ("coreai.authoring.graph_builder", "coreai.authoring.func", "coreai.authoring.metal")
DEBUGINFO_OPS = "coreai._compiler.dialects.debuginfo.ops"
EXTERNALIZE = "coreai_torch.externalize"
CONVERTER = "coreai_torch.converter"

# (assumption, check) pairs: what the patches rely on; each check returns True when it holds.
ASSUMPTIONS: list[tuple[str, Callable[[], bool]]] = []


def assumption(text: str):
    def register(check: Callable[[], bool]) -> Callable[[], bool]:
        ASSUMPTIONS.append((text, check))
        return check
    return register


def _mod(name: str):
    return importlib.import_module(name)


def _source(obj) -> str:
    return inspect.getsource(obj)


for _site in CHOICE_SITES:
    assumption(f"{_site} draws its random name suffixes from a module-level `choice` (from secrets import choice)")(
        lambda site=_site: "from secrets import choice" in _source(_mod(site)) and callable(_mod(site).choice))


@assumption("coreai.authoring.graph_builder._randomize_fn_name builds the suffix with choice(ascii_lowercase)")
def _graph_builder_uses_choice() -> bool:
    return "choice(ascii_lowercase)" in _source(_mod(CHOICE_SITES[0])._randomize_fn_name)


@assumption(f"{DEBUGINFO_OPS}.record takes a keyword-only `record_id` whose default comes from secrets.randbits(64)")
def _debuginfo_default() -> bool:
    record = _mod(DEBUGINFO_OPS).record
    return ("record_id" in (record.__kwdefaults__ or {})
            and "record_id: int = secrets.randbits(64)" in _source(record))


@assumption(f"{EXTERNALIZE} calls a module-level `uuid4` for its name suffixes")
def _externalize_uuid() -> bool:
    return _mod(EXTERNALIZE).uuid4 is uuid.uuid4 and "uuid4().hex" in _source(_mod(EXTERNALIZE))


@assumption(f"{ASSET}.AIProgram._save_bytecode writes main.mlirb through the module-level "
            "_serialize_module_to_bytecode(module, path, dialect_version=...) and save_asset hashes the file after it")
def _bytecode_writer() -> bool:
    asset = _mod(ASSET)
    params = list(inspect.signature(asset._serialize_module_to_bytecode).parameters)
    save = _source(asset.AIProgram.save_asset)
    return (params == ["module", "path", "dialect_version"]
            and "_serialize_module_to_bytecode(" in _source(asset.AIProgram._save_bytecode)
            and save.index("self._save_bytecode(") < save.index("hashlib.sha256(bytecode)"))


@assumption(f"{ASSET}.AIProgram.save_asset reads main.mlirb back with `bytecode = bytecode_path.read_bytes()` "
            "only to hash it with the module-level hashlib: `hashlib.sha256(bytecode).digest()`")
def _bytecode_hashed() -> bool:
    save = re.sub(r"#.*", "", _source(_mod(ASSET).AIProgram.save_asset))  # code only
    return (_mod(ASSET).hashlib is hashlib and "bytecode = bytecode_path.read_bytes()" in save
            and "hashlib.sha256(bytecode).digest()" in save and len(re.findall(r"\bbytecode\b", save)) == 2)


@assumption(f"{ASSET} writes MLIR bytecode version 6 (the layout canonicalize_resource_names parses)")
def _bytecode_version() -> bool:
    return _mod(ASSET)._CURRENT_BYTECODE_VERSION == 6


@assumption(f"{ASSET}.AIModelAsset._write_odix runs compile_to_binary(module=...) and then the module-level "
            "serialize_module_to_odix(module=..., path=...) on the same module")
def _odix_writer() -> bool:
    src = _source(_mod(ASSET).AIModelAsset._write_odix)
    return (callable(getattr(_mod(ASSET), "serialize_module_to_odix", None))
            and 0 <= src.find("compile_to_binary(") < src.find("serialize_module_to_odix(")
            and "module=module" in src[src.find("serialize_module_to_odix("):])


@assumption(f"{CONVERTER}.TorchConverter._handle_placeholder_op(node) turns a weight placeholder into "
            "self._values_map[target] = self._constant_from_tensor(<the tensor in one of its three maps>), a "
            "coreai.ConstantOp whose `value` attribute holds a copy of the data; get_target is module-level")
def _placeholder_copies() -> bool:
    conv = _mod(CONVERTER)
    placeholder = _source(conv.TorchConverter._handle_placeholder_op)
    constant = _source(conv.TorchConverter._constant_from_tensor)
    return (callable(getattr(conv, "get_target", None))
            and all(f"self._values_map[target] = self._constant_from_tensor(\n                self.{m}[target]"
                    in placeholder for m in ("_constants_map", "_parameters_map", "_buffers_map"))
            and "create_elements_attr(" in constant
            and constant.rstrip().endswith("return coreai.ConstantOp(value=value_attr).result"))


def _changed(what: str) -> PipelineError:
    from recurrent_coreai.coreai import toolchain

    return PipelineError(f"coreai-core {toolchain.versions()['coreai-core']}", f"reproducible build: {what}",
                         "install the pinned toolchain (make setup) or update recurrent_coreai/coreai/reproducible.py "
                         "(pytest tests/test_reproducible.py names the broken assumption)")


@contextlib.contextmanager
def _swap(module: str | object, name: str, make: Callable[[object], object]) -> Iterator[None]:
    """Replace ``module.name`` (a module's name, or any object) by ``make(original)`` until the block exits."""
    mod = _mod(module) if isinstance(module, str) else module
    if not hasattr(mod, name):
        raise _changed(f"{module}.{name} no longer exists")
    original = getattr(mod, name)
    setattr(mod, name, make(original))
    try:
        yield
    finally:
        setattr(mod, name, original)


@contextlib.contextmanager
def _swap_kwdefault(module: str, func: str, arg: str, value: object) -> Iterator[None]:
    fn = getattr(_mod(module), func, None)
    if fn is None or arg not in (fn.__kwdefaults__ or {}):
        raise _changed(f"{module}.{func} has no keyword default {arg!r}")
    original = fn.__kwdefaults__[arg]
    fn.__kwdefaults__[arg] = value
    try:
        yield
    finally:
        fn.__kwdefaults__[arg] = original


# --- Swift hashing (metadata.json key order) -------------------------------------------------

def _libswiftcore() -> Path | None:
    spec = importlib.util.find_spec("coreai")  # locates the package without importing (loading) it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0]) / "runtime" / "lib" / "swift" / "linux" / "libswiftCore.so"


def swift_hashing_deterministic() -> bool | None:
    """Whether the Swift runtime in this process hashes deterministically: read from its
    ``_swift_stdlib_Hashing_parameters`` (seed0, seed1, deterministic) if it is loaded, else
    from the environment it will read. None if that cannot be told (no such library/symbol)."""
    path = _libswiftcore()
    if path is None or not path.is_file():
        return None
    try:
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return os.environ.get(SWIFT_HASHING_ENV) == "1"  # not loaded yet: it will read the environment
    try:
        params = ctypes.c_uint8.in_dll(lib, "_swift_stdlib_Hashing_parameters")
    except ValueError:
        return None
    return bool(ctypes.c_uint8.from_address(ctypes.addressof(params) + 16).value)


def _warn_swift_hashing() -> None:
    if swift_hashing_deterministic() is False:
        log.warning("metadata.json key order will vary: the Swift runtime was loaded without %s=1 "
                    "(import recurrent_coreai before coreai, or set it in the environment)", SWIFT_HASHING_ENV)


# --- MLIR bytecode: canonical resource names ---------------------------------------------------

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


def _sections(fh) -> list[dict]:
    """The file's sections: id, offset of the section header, data offset, size, alignment."""
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
        secs = _sections(fh)
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


# --- main.hash without a second copy of main.mlirb -------------------------------------------

HASH_CHUNK = 16 << 20


class _Unread:
    """What ``read_bytes`` gives back for a ``main.mlirb`` written within :func:`export_scope`:
    the file, unread, which :class:`_ChunkedHashlib` hashes in chunks."""

    def __init__(self, path: Path):
        self.path = path


class _ChunkedHashlib:
    """``hashlib`` as ``coreai.authoring.asset`` sees it within :func:`export_scope`."""

    def __getattr__(self, name: str):
        return getattr(hashlib, name)

    @staticmethod
    def sha256(data=b""):
        if not isinstance(data, _Unread):
            return hashlib.sha256(data)
        digest = hashlib.sha256()
        with open(data.path, "rb") as fh:
            while chunk := fh.read(HASH_CHUNK):
                digest.update(chunk)
        return digest


# --- ODIX: canonical register resets ----------------------------------------------------------

def _is_zero_reset(op) -> bool:
    if op.name != "odix.load_imm" or len(op.operands) != 1 or len(op.results) != 0:
        return False
    return {a.name: str(a.attr) for a in op.attributes} == {"imm": "0 : i64"}


def canonicalize_register_resets(module) -> int:
    """In every ``odix.region`` of every ``odix.function``, give the trailing run of register
    resets (``odix.load_imm %r {imm = 0 : i64}``) their registers in definition order. Returns
    the number of resets seen. The multiset of reset registers is unchanged, and so is each op."""
    from coreai._compiler.ir import WalkOrder, WalkResult

    # Walk plain Operations: iterating a block builds an OpView per op, and each tries (and
    # fails) to import a Python module for the odix dialect (~0.2 ms per op).
    in_block: dict = {}

    def visit(op):
        in_block.setdefault(op.block, []).append(op)
        return WalkResult.ADVANCE

    seen = 0
    for fn in (op.operation for op in module.body.operations if op.operation.name == "odix.function"):
        fn.walk(visit, walk_order=WalkOrder.PRE_ORDER)
        body = fn.regions[0].blocks[0]
        order = {arg: (0, arg.arg_number) for arg in body.arguments}
        for i, op in enumerate(in_block.get(body, [])):
            order.update((res, (1, i)) for res in op.results)
        for region in (op for op in in_block.get(body, []) if op.name == "odix.region"):
            ops = in_block.get(region.regions[0].blocks[0], [])
            start = len(ops)
            while start > 0 and _is_zero_reset(ops[start - 1]):
                start -= 1
            resets = ops[start:]
            for op, reg in zip(resets, sorted((op.operands[0] for op in resets), key=lambda v: order[v])):
                if op.operands[0] != reg:
                    op.operands[0] = reg
            seen += len(resets)
    return seen


# --- ODIX: canonical function table ---------------------------------------------------------

ODIX_MAGIC = b"odix"
ODIX_HEADER = 64  # magic, version, header size; the program's size at byte 16


def _u32(buf: bytes | bytearray, pos: int) -> int:
    return int.from_bytes(buf[pos:pos + 4], "little")


def _vtable_of(buf: bytes | bytearray, table: int) -> int:
    """A FlatBuffers table starts with a signed offset back to its vtable."""
    return table - int.from_bytes(buf[table:table + 4], "little", signed=True)


def _function_tables(buf: bytes | bytearray, names: list[str]) -> dict[str, tuple[int, int]]:
    """``{name: (table, end)}``: each function's FlatBuffers table (soffset to a vtable, then
    two uoffsets: its name string and its index vector, both right after it) and where the
    last of the three ends."""
    found: dict[str, tuple[int, int]] = {}
    for name in names:
        pattern = len(name).to_bytes(4, "little") + name.encode() + b"\0"
        hits, at = [], buf.find(pattern)
        while at >= 0:
            for table in range(max(at - 64, 0), at, 4) if at % 4 == 0 else ():  # strings are 4-aligned
                vtable = _vtable_of(buf, table)
                if not 0 <= vtable < len(buf) - 8 or buf[vtable:vtable + 8] != b"\x08\x00\x0c\x00\x04\x00\x08\x00":
                    continue
                targets = [pos + _u32(buf, pos) for pos in (table + 4, table + 8)]
                if at in targets:
                    end = max(at + 4 + len(name) + 1, *(t + 4 + 4 * _u32(buf, t) for t in targets if t != at))
                    hits.append((table, -(-end // 4) * 4))
            at = buf.find(pattern, at + 1)
        if len(hits) != 1:
            raise _changed(f"{len(hits)} function tables named {name!r} in the .odix (expected 1)")
        found[name] = hits[0]
    return found


def canonicalize_function_table(path: Path, order: list[str]) -> bool:
    """Put the ``.odix`` function table in ``order`` (every function's name), in place. The
    tables are equal-sized blocks (table, index vector, name); moving a block only changes its
    offset to the shared vtable. Returns whether the file changed."""
    names = list(order)
    if len(names) < 2:
        return False
    with open(path, "r+b") as fh:
        head = bytearray(fh.read(ODIX_HEADER))
        if head[:4] != ODIX_MAGIC:
            raise _changed(f"{path.name} does not start with {ODIX_MAGIC!r}")
        head += fh.read(_u32(head, 16))  # the FlatBuffers program (code, tables); weights follow it
        tables = _function_tables(head, names)
        starts = sorted(table for table, _ in tables.values())
        sizes = {end - table for table, end in tables.values()}
        if len(sizes) != 1 or any(b - a != next(iter(sizes)) for a, b in zip(starts, starts[1:])):
            raise _changed(f"the function tables of {path.name} are not adjacent equal-sized blocks")
        size = sizes.pop()
        by_start = {table: name for name, (table, _) in tables.items()}
        vectors = [pos for pos in range(8, starts[0] - 4 * len(names), 4)
                   if _u32(head, pos - 4) == len(names)
                   and sorted(pos + 4 * i + _u32(head, pos + 4 * i) for i in range(len(names))) == starts]
        if len(vectors) != 1:
            raise _changed(f"{len(vectors)} function vectors in {path.name} (expected 1)")
        slots = [vectors[0] + 4 * i + _u32(head, vectors[0] + 4 * i) for i in range(len(names))]
        if [by_start[s] for s in slots] == names:
            return False
        blocks = {name: bytes(head[t:t + size]) for name, (t, _) in tables.items()}
        vtables = {name: _vtable_of(head, table) for name, (table, _) in tables.items()}
        for slot, name in zip(slots, names):
            head[slot:slot + size] = (slot - vtables[name]).to_bytes(4, "little", signed=True) + blocks[name][4:]
        fh.seek(0)
        fh.write(head[:starts[-1] + size])
    return True


def _function_names(module) -> list[str]:
    """The callable functions (``@main``, ``@prefill``), not the lowering's helpers (``@"$main"``)."""
    names = (str(op.operation.attributes["sym_name"]).lstrip("@").strip('"') for op in module.body.operations
             if op.operation.name == "odix.function")
    return [name for name in names if not name.startswith("$")]


# --- the scopes -------------------------------------------------------------------------------

@contextlib.contextmanager
def export_scope(seed: str) -> Iterator[None]:
    """Within the block, a coreai-torch conversion + ``save_asset`` is a function of its inputs
    and ``seed`` (use something that names the bundle; never a path or a time), and
    ``save_asset`` hashes the ``main.mlirb`` it wrote in chunks rather than reading it whole."""
    _warn_swift_hashing()
    rng = random.Random(f"rwkv7-coreai export {seed}")

    def seeded_uuid4() -> uuid.UUID:
        return uuid.UUID(int=rng.getrandbits(128), version=4)

    written: set[Path] = set()

    def canonical_writer(original):
        def write(module, path, dialect_version):
            original(module, path, dialect_version=dialect_version)
            try:
                canonicalize_resource_names(Path(path))
            except (ValueError, IndexError) as exc:
                raise _changed(f"main.mlirb is not the bytecode this module understands ({exc})") from None
            written.add(Path(path))
        return write

    def unread_bytecode(original):
        def read_bytes(self):
            return _Unread(self) if self in written else original(self)
        return read_bytes

    with contextlib.ExitStack() as stack:
        for site in CHOICE_SITES:
            stack.enter_context(_swap(site, "choice", lambda _: rng.choice))
        stack.enter_context(_swap_kwdefault(DEBUGINFO_OPS, "record", "record_id", rng.getrandbits(64)))
        stack.enter_context(_swap(EXTERNALIZE, "uuid4", lambda _: seeded_uuid4))
        stack.enter_context(_swap(ASSET, "_serialize_module_to_bytecode", canonical_writer))
        stack.enter_context(_swap(ASSET, "hashlib", lambda _: _ChunkedHashlib()))
        stack.enter_context(_swap(pathlib.Path, "read_bytes", unread_bytecode))
        yield


@contextlib.contextmanager
def lowering_scope() -> Iterator[None]:
    """Within the block, ``AIModelAsset._write_odix`` writes a ``.odix`` that is a function of
    the bundle alone."""

    def canonical_serializer(original):
        def serialize(*args, **kwargs):
            module = kwargs["module"] if "module" in kwargs else args[0]
            canonicalize_register_resets(module)
            result = original(*args, **kwargs)
            path = Path(kwargs["path"] if "path" in kwargs else args[1])
            canonicalize_function_table(path, sorted(_function_names(module)))
            return result
        return serialize

    with _swap(ASSET, "serialize_module_to_odix", canonical_serializer):
        yield



@contextlib.contextmanager
def constants_released() -> Iterator[None]:
    """Within the block, coreai-torch frees each weight's torch storage once it has copied it into
    a constant, and a later use of the same tensor (the next function over the same weights) gets
    a constant with the very same attribute: the weights are held once, in the IR, instead of
    once in torch and once (or twice) in the IR. A weight is freed by emptying the tensor the
    exported program holds (``tensor.data = empty``), which the module shares: use it on a module
    nobody needs afterwards."""
    import torch

    converter = _mod(CONVERTER)
    attrs: dict[int, object] = {}
    keep: list = []  # the emptied tensors, so that their ids stay unique within the block

    def owners(ep) -> dict[str, object]:
        tensors = {**ep.state_dict, **ep.constants}
        return {s.arg.name: tensors[s.target] for s in ep.graph_signature.input_specs if s.target in tensors}

    def released(original):
        def placeholder(self, node):
            target = converter.get_target(node)
            maps = (self._constants_map, self._parameters_map, self._buffers_map)
            owner = owners(self.exported_program).get(target)
            if owner is None or not any(target in m for m in maps):
                return original(self, node)
            if id(owner) in attrs:
                self._values_map[target] = converter.coreai.ConstantOp(value=attrs[id(owner)]).result
                return None
            original(self, node)
            attrs[id(owner)] = self._values_map[target].owner.attributes["value"]
            keep.append(owner)
            for m in maps:
                m.pop(target, None)  # the converter's own view of the weight
            owner.data = torch.empty(0, dtype=owner.dtype)
            if isinstance(getattr(owner, "elem", None), torch.Tensor):  # a packed sub-byte tensor's own storage
                owner.elem = torch.empty(0, dtype=owner.elem.dtype)
            return None
        return placeholder

    cls = converter.TorchConverter
    original = cls._handle_placeholder_op
    cls._handle_placeholder_op = released(original)
    try:
        yield
    finally:
        cls._handle_placeholder_op = original
