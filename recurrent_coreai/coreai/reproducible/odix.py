"""The universal ``.odix``: canonical register resets and function table.

* The register resets (``odix.load_imm %r {imm = 0 : i64}``) that end each ``odix.region`` come
  out of native ``compile_to_binary`` in heap-address order. :func:`canonicalize_register_resets`
  gives them their registers in definition order before ``serialize_module`` writes the file (a
  set of independent resets to zero; the ops themselves stay where they are, each carries a
  positional op id).
* With more than one function (``main`` + ``prefill``), the file's function table (a FlatBuffers
  vector of ``{name, indices}`` tables) also comes out in either order;
  :func:`canonicalize_function_table` moves the tables so that the vector is in name order, which
  is byte for byte what coreai writes when it happens to pick that order."""

from __future__ import annotations

from pathlib import Path

from recurrent_coreai.coreai.reproducible.patches import toolchain_changed

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
            raise toolchain_changed(f"{len(hits)} function tables named {name!r} in the .odix (expected 1)")
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
            raise toolchain_changed(f"{path.name} does not start with {ODIX_MAGIC!r}")
        head += fh.read(_u32(head, 16))  # the FlatBuffers program (code, tables); weights follow it
        tables = _function_tables(head, names)
        starts = sorted(table for table, _ in tables.values())
        sizes = {end - table for table, end in tables.values()}
        if len(sizes) != 1 or any(b - a != next(iter(sizes)) for a, b in zip(starts, starts[1:])):
            raise toolchain_changed(f"the function tables of {path.name} are not adjacent equal-sized blocks")
        size = sizes.pop()
        by_start = {table: name for name, (table, _) in tables.items()}
        vectors = [pos for pos in range(8, starts[0] - 4 * len(names), 4)
                   if _u32(head, pos - 4) == len(names)
                   and sorted(pos + 4 * i + _u32(head, pos + 4 * i) for i in range(len(names))) == starts]
        if len(vectors) != 1:
            raise toolchain_changed(f"{len(vectors)} function vectors in {path.name} (expected 1)")
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


def function_names(module) -> list[str]:
    """The callable functions (``@main``, ``@prefill``), not the lowering's helpers (``@"$main"``)."""
    names = (str(op.operation.attributes["sym_name"]).lstrip("@").strip('"') for op in module.body.operations
             if op.operation.name == "odix.function")
    return [name for name in names if not name.startswith("$")]
