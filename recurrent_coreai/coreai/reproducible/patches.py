"""What the patches touch in coreai-* and what they rely on there, and how they patch.

* The patch sites (module names) every other module of this package patches or parses.
* :data:`ASSUMPTIONS`: one :class:`Assumption` per fact about coreai's internals a patch relies
  on: its text, its check, the target that must exist (``module`` or ``module:Attr.path``), the
  patch it belongs to and what is lost without it. ``tests/test_reproducible.py`` runs every check
  against the installed coreai; ``recurrent_coreai/coreai/contract.py`` states them in the
  toolchain contract beside the public API the pipeline calls.
* Degrade, never die: a scope applies a patch only when every assumption of it holds
  (:func:`usable`); otherwise the build runs unpatched, the miss is recorded for whoever collects
  them (:func:`collect_misses`: the export stage, into export.json) and logged in ONE warning line
  per run (:func:`warn_misses`). The target is looked up before anything is imported from it
  (:func:`target_missing`): a module a beta dropped is a miss, not a ModuleNotFoundError.
* :func:`swap` / :func:`swap_kwdefault`: replace an attribute (or a keyword default) until the
  block exits, and :func:`toolchain_changed`, the one-line error when a patch site is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator

from recurrent_coreai.util.errors import PipelineError

log = logging.getLogger(__name__)

ASSET = "coreai.authoring.asset"
CHOICE_SITES = ("coreai.authoring.graph_builder", "coreai.authoring.func", "coreai.authoring.metal")
DEBUGINFO_OPS = "coreai._compiler.dialects.debuginfo.ops"
EXTERNALIZE = "coreai_torch.externalize"
CONVERTER = "coreai_torch.converter"

# The patches (keys of Assumption.patch) and what a build loses without each.
SUFFIXES = "op-name suffixes are random: main.mlirb and main.hash are not byte-reproducible"
PATCHES = {
    **{f"choice {site}": SUFFIXES for site in CHOICE_SITES},
    "debuginfo record_id": SUFFIXES,
    "externalize uuid4": SUFFIXES,
    "resource names": "weight-blob names follow a load address: main.mlirb and main.hash are not byte-reproducible",
    "chunked hash": "save_asset reads main.mlirb whole to hash it (a second copy in memory); bytes unaffected",
    "odix order": "register resets and the function table of the .odix come out in native order: the universal "
                  "lowering is not byte-reproducible",
    "constants released": "each weight is held in torch and in the IR during the conversion (more peak memory); "
                          "bytes unaffected",
}
MEMORY_ONLY = ("chunked hash", "constants released")  # patches whose loss does not change a byte


@dataclass(frozen=True)
class Assumption:
    """A fact about coreai's internals that a patch relies on."""
    text: str
    check: Callable[[], bool]  # True while ``text`` holds
    target: str  # what must exist before the patch touches it: "module" or "module:Attr.path"
    patch: str  # a key of PATCHES

    @property
    def degrades(self) -> str:
        return PATCHES[self.patch]

    @property
    def bytes(self) -> bool:
        """Whether a build without this patch can differ in its bytes."""
        return self.patch not in MEMORY_ONLY


ASSUMPTIONS: list[Assumption] = []


def assumption(text: str, target: str, patch: str):
    """Decorator: register ``check`` (returns True while ``text`` holds) in :data:`ASSUMPTIONS`."""
    if patch not in PATCHES:
        raise ValueError(f"unknown patch {patch!r}")

    def register(check: Callable[[], bool]) -> Callable[[], bool]:
        ASSUMPTIONS.append(Assumption(text, check, target, patch))
        return check
    return register


def _mod(name: str):
    return importlib.import_module(name)


def _source(obj) -> str:
    return inspect.getsource(obj)


def target_missing(target: str) -> str | None:
    """Why ``target`` (``module`` or ``module:Attr.path``) is not there, or None when it is: a
    dropped module or attribute is a reason, never an exception out of the lookup."""
    module, _, attrs = target.partition(":")
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        return f"no module {exc.name or module}"
    except Exception as exc:  # noqa: BLE001 - a module that no longer imports is a miss like any other
        return f"{module} does not import ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]})"
    path = module
    for name in filter(None, attrs.split(".")):
        if not hasattr(obj, name):
            return f"no attribute {path}.{name}"
        obj, path = getattr(obj, name), f"{path}.{name}"
    return None


def broken(a: Assumption) -> str | None:
    """Why assumption ``a`` does not hold on the installed coreai (its target missing, or its
    check false or failing), or None when it holds."""
    why = target_missing(a.target)
    if why is not None:
        return why
    try:
        if a.check():
            return None
        return f"changed: NOT TRUE ANY MORE: {a.text}"
    except Exception as exc:  # noqa: BLE001 - a vanished attribute is exactly what we report
        return f"changed: NOT TRUE ANY MORE: {a.text} ({type(exc).__name__}: {exc})"


for _site in CHOICE_SITES:
    assumption(f"{_site} draws its random name suffixes from a module-level `choice` (from secrets import choice)",
               f"{_site}:choice", f"choice {_site}")(
        lambda site=_site: "from secrets import choice" in _source(_mod(site)) and callable(_mod(site).choice))


@assumption("coreai.authoring.graph_builder._randomize_fn_name builds the suffix with choice(ascii_lowercase)",
            f"{CHOICE_SITES[0]}:_randomize_fn_name", f"choice {CHOICE_SITES[0]}")
def _graph_builder_uses_choice() -> bool:
    return "choice(ascii_lowercase)" in _source(_mod(CHOICE_SITES[0])._randomize_fn_name)


@assumption(f"{DEBUGINFO_OPS}.record takes a keyword-only `record_id` whose default comes from secrets.randbits(64)",
            f"{DEBUGINFO_OPS}:record", "debuginfo record_id")
def _debuginfo_default() -> bool:
    record = _mod(DEBUGINFO_OPS).record
    return ("record_id" in (record.__kwdefaults__ or {})
            and "record_id: int = secrets.randbits(64)" in _source(record))


@assumption(f"{EXTERNALIZE} calls a module-level `uuid4` for its name suffixes", f"{EXTERNALIZE}:uuid4",
            "externalize uuid4")
def _externalize_uuid() -> bool:
    return _mod(EXTERNALIZE).uuid4 is uuid.uuid4 and "uuid4().hex" in _source(_mod(EXTERNALIZE))


@assumption(f"{ASSET}.AIProgram._save_bytecode writes main.mlirb through the module-level "
            "_serialize_module_to_bytecode(module, path, dialect_version=...) and save_asset hashes the file after it",
            f"{ASSET}:_serialize_module_to_bytecode", "resource names")
def _bytecode_writer() -> bool:
    asset = _mod(ASSET)
    params = list(inspect.signature(asset._serialize_module_to_bytecode).parameters)
    save = _source(asset.AIProgram.save_asset)
    return (params == ["module", "path", "dialect_version"]
            and "_serialize_module_to_bytecode(" in _source(asset.AIProgram._save_bytecode)
            and save.index("self._save_bytecode(") < save.index("hashlib.sha256(bytecode)"))


@assumption(f"{ASSET}.AIProgram.save_asset reads main.mlirb back with `bytecode = bytecode_path.read_bytes()` "
            "only to hash it with the module-level hashlib: `hashlib.sha256(bytecode).digest()`",
            f"{ASSET}:AIProgram.save_asset", "chunked hash")
def _bytecode_hashed() -> bool:
    save = re.sub(r"#.*", "", _source(_mod(ASSET).AIProgram.save_asset))  # code only
    return (_mod(ASSET).hashlib is hashlib and "bytecode = bytecode_path.read_bytes()" in save
            and "hashlib.sha256(bytecode).digest()" in save and len(re.findall(r"\bbytecode\b", save)) == 2)


@assumption(f"{ASSET} writes MLIR bytecode version 6 (the layout canonicalize_resource_names parses)",
            f"{ASSET}:_CURRENT_BYTECODE_VERSION", "resource names")
def _bytecode_version() -> bool:
    return _mod(ASSET)._CURRENT_BYTECODE_VERSION == 6


@assumption(f"{ASSET}.AIModelAsset._write_odix runs compile_to_binary(module=...) and then the module-level "
            "serialize_module_to_odix(module=..., path=...) on the same module",
            f"{ASSET}:AIModelAsset._write_odix", "odix order")
def _odix_writer() -> bool:
    src = _source(_mod(ASSET).AIModelAsset._write_odix)
    return (callable(getattr(_mod(ASSET), "serialize_module_to_odix", None))
            and 0 <= src.find("compile_to_binary(") < src.find("serialize_module_to_odix(")
            and "module=module" in src[src.find("serialize_module_to_odix("):])


@assumption(f"{CONVERTER}.TorchConverter._handle_placeholder_op(node) turns a weight placeholder into "
            "self._values_map[target] = self._constant_from_tensor(<the tensor in one of its three maps>), a "
            "coreai.ConstantOp whose `value` attribute holds a copy of the data; get_target is module-level",
            f"{CONVERTER}:TorchConverter._handle_placeholder_op", "constants released")
def _placeholder_copies() -> bool:
    conv = _mod(CONVERTER)
    placeholder = _source(conv.TorchConverter._handle_placeholder_op)
    constant = _source(conv.TorchConverter._constant_from_tensor)
    return (callable(getattr(conv, "get_target", None))
            and all(f"self._values_map[target] = self._constant_from_tensor(\n                self.{m}[target]"
                    in placeholder for m in ("_constants_map", "_parameters_map", "_buffers_map"))
            and "create_elements_attr(" in constant
            and constant.rstrip().endswith("return coreai.ConstantOp(value=value_attr).result"))


class ToolchainChanged(PipelineError):
    """A coreai that is not what a patch relies on (a scope that meets one degrades instead)."""

    def __reduce__(self):
        return ToolchainChanged, (self.where, self.what, self.fix)


def toolchain_changed(what: str) -> ToolchainChanged:
    """The one-line error for a coreai that no longer is what the patches rely on."""
    from recurrent_coreai.coreai import toolchain

    return ToolchainChanged(f"coreai-core {toolchain.versions()['coreai-core']}", f"reproducible build: {what}",
                            "install the pinned toolchain (make setup) or update recurrent_coreai/coreai/reproducible/ "
                            "(docs/toolchain.md: the toolchain contract)")


def package_of(target: str) -> str:
    """The distribution a target lives in: ``coreai_torch.x`` -> coreai-core's sibling coreai-torch."""
    top = target.partition(":")[0].split(".")[0]
    return {"coreai": "coreai-core"}.get(top, top.replace("_", "-"))


def miss(target: str, why: str, degrades: str, bytes_: bool, assumption_text: str | None = None) -> dict:
    """One miss as records carry it (export.json ``toolchain_misses``, the beta report)."""
    from recurrent_coreai.coreai import toolchain

    package = package_of(target)
    return {"package": package, "version": toolchain.versions().get(package, "absent"), "target": target,
            "why": why, "degrades": degrades, "bytes": bytes_,
            **({"assumption": assumption_text} if assumption_text else {})}


_collectors: list[list[dict]] = []
_warned: set[str] = set()


@contextlib.contextmanager
def collect_misses() -> Iterator[list[dict]]:
    """Within the block, every miss a scope meets is appended (once) to the list it yields."""
    found: list[dict] = []
    _collectors.append(found)
    try:
        yield found
    finally:
        _collectors.remove(found)


def warn_misses(misses: list[dict]) -> None:
    """Record ``misses`` for every collector and log them in ONE warning line, once per process
    (a second scope meeting the same misses logs nothing)."""
    for found in _collectors:
        found.extend(m for m in misses if m not in found)
    new = [m for m in misses if f"{m['target']}: {m['why']}" not in _warned]
    if not new:
        return
    _warned.update(f"{m['target']}: {m['why']}" for m in new)
    versions = sorted({f"{m['package']} {m['version']}" for m in new})
    whats = sorted({m["degrades"] for m in new})
    log.warning("toolchain: %s: %s -- so %s (docs/toolchain.md)", ", ".join(versions),
                "; ".join(dict.fromkeys(m["why"] for m in new)), "; ".join(whats))


def patch_misses(*patches: str) -> list[dict]:
    """The misses of ``patches``: one per assumption of theirs that does not hold here."""
    out = []
    for a in ASSUMPTIONS:
        if a.patch in patches:
            why = broken(a)
            if why is not None:
                out.append(miss(a.target, why, a.degrades, a.bytes, a.text))
    return out


def usable(misses: list[dict], *patches: str) -> bool:
    """Whether none of ``misses`` (from :func:`patch_misses`) belongs to ``patches``."""
    keys = {a.text for a in ASSUMPTIONS if a.patch in patches}
    return not any(m.get("assumption") in keys for m in misses)


@contextlib.contextmanager
def swap(module: str | object, name: str, make: Callable[[object], object]) -> Iterator[None]:
    """Replace ``module.name`` (a module's name, or any object) by ``make(original)`` until the
    block exits. The target is looked up first: a module or attribute that is gone is
    :func:`toolchain_changed`, never an ImportError from the lookup itself."""
    if isinstance(module, str):
        why = target_missing(f"{module}:{name}")
        if why is not None:
            raise toolchain_changed(f"{module}.{name} no longer exists ({why})")
        mod = _mod(module)
    else:
        mod = module
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
    why = target_missing(f"{module}:{func}")
    fn = None if why is not None else getattr(_mod(module), func)
    if fn is None or arg not in (fn.__kwdefaults__ or {}):
        raise toolchain_changed(f"{module}.{func} has no keyword default {arg!r}")
    original = fn.__kwdefaults__[arg]
    fn.__kwdefaults__[arg] = value
    try:
        yield
    finally:
        fn.__kwdefaults__[arg] = original
