"""The scopes a conversion and a lowering run in: every patch of coreai-* internals is made on
entry and undone on exit (see the package docstring for what each one removes).

Degrade, never die: a patch whose assumptions do not all hold on the installed coreai (a target
gone, a changed internal) is not made; the scope runs without it, and the miss is recorded and
warned about once (:func:`.patches.warn_misses`). The same holds for a canonicalisation that meets
a file it does not understand: the file is left as coreai wrote it."""

from __future__ import annotations

import contextlib
import importlib
import pathlib
import random
import uuid
from pathlib import Path
from typing import Iterator

from recurrent_coreai.coreai.reproducible.bytecode import canonicalize_resource_names
from recurrent_coreai.coreai.reproducible.chunked_hash import ChunkedHashlib, Unread
from recurrent_coreai.coreai.reproducible.odix import (canonicalize_function_table, canonicalize_register_resets,
                                                        function_names)
from recurrent_coreai.coreai.reproducible.patches import (ASSET, CHOICE_SITES, CONVERTER, DEBUGINFO_OPS, EXTERNALIZE,
                                                           PATCHES, ToolchainChanged, miss, patch_misses, swap,
                                                           swap_kwdefault, usable, warn_misses)
from recurrent_coreai.coreai.reproducible.swift import warn_unless_swift_hashing_deterministic

# The string that seeds every random draw of an export (``seed`` names the bundle). It seeds the
# bytes of every published bundle: changing it changes them all, so it stays as it was first
# published (under the package's first name), whatever the package is called now.
EXPORT_SEED = "rwkv7-coreai export {seed}"


@contextlib.contextmanager
def export_scope(seed: str) -> Iterator[None]:
    """Within the block, a coreai-torch conversion + ``save_asset`` is a function of its inputs
    and ``seed`` (use something that names the bundle; never a path or a time), and
    ``save_asset`` hashes the ``main.mlirb`` it wrote in chunks rather than reading it whole."""
    warn_unless_swift_hashing_deterministic()
    rng = random.Random(EXPORT_SEED.format(seed=seed))  # a str seed is hashed with SHA-512, not hash()

    def seeded_uuid4() -> uuid.UUID:
        return uuid.UUID(int=rng.getrandbits(128), version=4)

    written: set[Path] = set()

    def canonical_writer(original):
        def write(module, path, dialect_version):
            original(module, path, dialect_version=dialect_version)
            try:  # it parses everything before it writes: a file it refuses is left as coreai wrote it
                canonicalize_resource_names(Path(path))
            except (ValueError, IndexError) as exc:
                warn_misses([miss(f"{ASSET}:_serialize_module_to_bytecode", f"main.mlirb is not the bytecode "
                                  f"canonicalize_resource_names understands ({exc})", PATCHES["resource names"], True)])
                return
            written.add(Path(path))
        return write

    def unread_bytecode(original):
        def read_bytes(self):
            return Unread(self) if self in written else original(self)
        return read_bytes

    keys = [*(f"choice {site}" for site in CHOICE_SITES), "debuginfo record_id", "externalize uuid4",
            "resource names", "chunked hash"]
    misses = patch_misses(*keys)
    warn_misses(misses)
    with contextlib.ExitStack() as stack:
        for site in CHOICE_SITES:
            if usable(misses, f"choice {site}"):
                stack.enter_context(swap(site, "choice", lambda _: rng.choice))
        if usable(misses, "debuginfo record_id"):
            stack.enter_context(swap_kwdefault(DEBUGINFO_OPS, "record", "record_id", rng.getrandbits(64)))
        if usable(misses, "externalize uuid4"):
            stack.enter_context(swap(EXTERNALIZE, "uuid4", lambda _: seeded_uuid4))
        if usable(misses, "resource names"):
            stack.enter_context(swap(ASSET, "_serialize_module_to_bytecode", canonical_writer))
            if usable(misses, "chunked hash"):  # it hashes only what the canonical writer wrote
                stack.enter_context(swap(ASSET, "hashlib", lambda _: ChunkedHashlib()))
                stack.enter_context(swap(pathlib.Path, "read_bytes", unread_bytecode))
        yield


@contextlib.contextmanager
def lowering_scope() -> Iterator[None]:
    """Within the block, ``AIModelAsset._write_odix`` writes a ``.odix`` that is a function of
    the bundle alone."""

    def refused(exc: Exception) -> None:
        warn_misses([miss(f"{ASSET}:serialize_module_to_odix", f"the .odix is not what reproducible/odix.py "
                          f"understands ({getattr(exc, 'what', exc)})", PATCHES["odix order"], True)])

    def canonical_serializer(original):
        def serialize(*args, **kwargs):
            module = kwargs["module"] if "module" in kwargs else args[0]
            try:  # only swaps reset registers among themselves: a refusal leaves a valid program
                canonicalize_register_resets(module)
            except (ToolchainChanged, ValueError, IndexError, AttributeError, ImportError) as exc:
                refused(exc)
            result = original(*args, **kwargs)
            path = Path(kwargs["path"] if "path" in kwargs else args[1])
            try:  # parses the whole table before it writes
                canonicalize_function_table(path, sorted(function_names(module)))
            except (ToolchainChanged, ValueError, IndexError) as exc:
                refused(exc)
            return result
        return serialize

    misses = patch_misses("odix order")
    warn_misses(misses)
    with swap(ASSET, "serialize_module_to_odix", canonical_serializer) if usable(misses, "odix order") \
            else contextlib.nullcontext():
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

    misses = patch_misses("constants released")
    warn_misses(misses)
    if not usable(misses, "constants released"):
        yield
        return
    converter = importlib.import_module(CONVERTER)
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
