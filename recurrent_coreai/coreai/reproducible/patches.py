"""What the patches touch in coreai-* and what they rely on there, and how they patch.

* The patch sites (module names) every other module of this package patches or parses.
* :data:`ASSUMPTIONS`: ``(text, check)`` pairs, one per fact about coreai's internals a patch
  relies on; ``tests/test_reproducible.py`` runs every check against the installed coreai and
  fails with the text of the one an upgrade broke.
* :func:`swap` / :func:`swap_kwdefault`: replace an attribute (or a keyword default) until the
  block exits, and :func:`toolchain_changed`, the one-line error when a patch site is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import re
import uuid
from typing import Callable, Iterator

from recurrent_coreai.util.errors import PipelineError

ASSET = "coreai.authoring.asset"
CHOICE_SITES = ("coreai.authoring.graph_builder", "coreai.authoring.func", "coreai.authoring.metal")
DEBUGINFO_OPS = "coreai._compiler.dialects.debuginfo.ops"
EXTERNALIZE = "coreai_torch.externalize"
CONVERTER = "coreai_torch.converter"

# (assumption, check) pairs: what the patches rely on; each check returns True when it holds.
ASSUMPTIONS: list[tuple[str, Callable[[], bool]]] = []


def assumption(text: str):
    """Decorator: register ``check`` (returns True while ``text`` holds) in :data:`ASSUMPTIONS`."""
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


def toolchain_changed(what: str) -> PipelineError:
    """The one-line error for a coreai that no longer is what the patches rely on."""
    from recurrent_coreai.coreai import toolchain

    return PipelineError(f"coreai-core {toolchain.versions()['coreai-core']}", f"reproducible build: {what}",
                         "install the pinned toolchain (make setup) or update recurrent_coreai/coreai/reproducible/ "
                         "(pytest tests/test_reproducible.py names the broken assumption)")


@contextlib.contextmanager
def swap(module: str | object, name: str, make: Callable[[object], object]) -> Iterator[None]:
    """Replace ``module.name`` (a module's name, or any object) by ``make(original)`` until the block exits."""
    mod = _mod(module) if isinstance(module, str) else module
    if not hasattr(mod, name):
        raise toolchain_changed(f"{module}.{name} no longer exists")
    original = getattr(mod, name)
    setattr(mod, name, make(original))
    try:
        yield
    finally:
        setattr(mod, name, original)


@contextlib.contextmanager
def swap_kwdefault(module: str, func: str, arg: str, value: object) -> Iterator[None]:
    """Set the keyword-only default ``arg`` of ``module.func`` to ``value`` until the block exits."""
    fn = getattr(_mod(module), func, None)
    if fn is None or arg not in (fn.__kwdefaults__ or {}):
        raise toolchain_changed(f"{module}.{func} has no keyword default {arg!r}")
    original = fn.__kwdefaults__[arg]
    fn.__kwdefaults__[arg] = value
    try:
        yield
    finally:
        fn.__kwdefaults__[arg] = original
