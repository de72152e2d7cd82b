"""The toolchain contract: what the pipeline needs of coreai-core, coreai-torch and coreai-opt.

:data:`PUBLIC` lists the API the pipeline calls (where, and what fails without it); the internals
the reproducible-build patches touch are :data:`.reproducible.patches.ASSUMPTIONS` (each with its
target and what a build loses without it). :func:`contract` is the one list of both
(docs/toolchain.md prints it). :func:`check` checks it against the installed packages: live
(importing them, and running each assumption's check) or static (reading their files, importing
nothing: what the doctor stage does per recipe, where importing coreai-opt alone costs seconds).
Each miss is one line (:func:`miss_line`) saying what degrades. ``beta-watch`` runs
``python -m recurrent_coreai.coreai.contract --json`` in its venv of the new versions before it
rebuilds. (A module of its own: the toolchain stage, which every job follows, imports only
:mod:`.toolchain`, so editing a patch does not rerun the whole DAG.)
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from recurrent_coreai.coreai import lowering
from recurrent_coreai.coreai.reproducible.patches import PATCHES
from recurrent_coreai.coreai.toolchain import versions


@dataclass(frozen=True)
class Need:
    """One thing the pipeline needs of a coreai-* package."""
    target: str  # "module" or "module:Attr.path"
    used_by: str  # where the pipeline uses it
    degrades: str  # what happens without it
    kind: str = "public"  # "public": API the pipeline calls; "internal": what a reproducible patch touches
    bytes: bool = False  # without it, bundles built are not byte-reproducible (they still build)
    check: Callable[[], bool] | None = None  # an internal's assumption check (live checks only)
    text: str | None = None  # the assumption, as reproducible/patches.py states it
    # where the pipeline goes without it: the targets that fallback uses, and what it costs. A miss
    # whose fallback holds degrades to ``instead``; with the fallback missing too, to ``degrades``
    or_else: tuple[str, ...] = ()
    instead: str | None = None

    @property
    def package(self) -> str:
        from recurrent_coreai.coreai.reproducible.patches import package_of

        return package_of(self.target)


_ASSET, _IR = "coreai.authoring.asset", "coreai._compiler.ir"
EXPORT_FAILS = "every export fails"
LOWERING_FAILS = "the universal lowering fails: aot universal and every gate fail"
FOLD_FAILS = "the gate cannot fold constants (gate_lowering.py): a quantised or fp32 World-vocabulary gate runs the aot lowering, ~4-5x slower"
RUNTIME_FAILS = "no bundle runs on this host: every gate (and generate) fails"
QUANT_FAILS = "quantised recipes (int8keepproj, int8, int4keepproj, ...) fail to export; fp16/fp32 still build"

# what lowering.py reads and writes a program with, and the passes it runs without compile_to_binary
_LOWERING_PARTS = (f"{_ASSET}:Context", f"{_ASSET}:load_module_from_bytecode", f"{_ASSET}:serialize_module_to_odix")
_FALLBACK_BINDINGS = tuple(f"{lowering.NATIVE}:{name}" for name in ("apply_passes", "PassEntry", "Options"))

# The public API (and the private methods) the pipeline calls, as it calls it.
PUBLIC: tuple[Need, ...] = (
    Need("coreai_torch:TorchConverter.Mode.RELEASE", "convert.save_functions", EXPORT_FAILS),
    Need("coreai_torch:TorchConverter.add_exported_program", "convert.save_functions", EXPORT_FAILS),
    Need("coreai_torch:TorchConverter.to_coreai", "convert.save_functions", EXPORT_FAILS),
    Need("coreai_torch:get_decomp_table", "convert.trace", EXPORT_FAILS),
    Need(f"{_ASSET}:AIModelAsset.load", "convert, runtime", EXPORT_FAILS),
    Need(f"{_ASSET}:AIModelAsset.update_metadata", "convert.save_functions (the fixed creation date)", EXPORT_FAILS),
    Need(f"{_ASSET}:AIModelAsset.summary", "runtime.bundle_signature (the export's function check)", EXPORT_FAILS),
    Need(f"{_ASSET}:AIModelAsset.is_valid", "runtime.lower_universal", LOWERING_FAILS),
    Need(f"{_ASSET}:AIModelAsset._write_odix", "lowering.lower (private: the Linux lowering)", LOWERING_FAILS,
         or_else=_LOWERING_PARTS, instead="lowering.lower reads main.mlirb, compiles and serialises it itself "
         "(what _write_odix does)"),
    Need(f"{_ASSET}:compile_to_binary", "lowering.compile_module (the fallback lowering, constant_fold)",
         f"{LOWERING_FAILS} where _write_odix is missing; {FOLD_FAILS}", or_else=_FALLBACK_BINDINGS,
         instead=f"lowering.compile_module runs the passes {lowering.FALLBACK} (what this coreai-core's own "
         "AIModelAsset.executable() runs)"),
    *(Need(target, "lowering (the fallback lowering), constant_fold",
           f"{LOWERING_FAILS} where _write_odix is missing; {FOLD_FAILS}") for target in _LOWERING_PARTS),
    Need("coreai._compiler.dialects.coreai:ConstantOp", "constant_fold", FOLD_FAILS),
    *(Need(target, "constant_fold (fp32 matmuls)", FOLD_FAILS) for target in (
        "coreai._compiler.dialects.coreai:TransposeOp", "coreai._compiler.dialects.coreai:BroadcastingBatchMatmul",
        f"{_IR}:DenseElementsAttr", f"{_IR}:IntegerType", f"{_IR}:RankedTensorType")),
    *(Need(target, "constant_fold", FOLD_FAILS) for target in (
        f"{_IR}:DenseResourceElementsAttr", f"{_IR}:InsertionPoint")),
    Need(f"{_IR}:WalkResult", "constant_fold, reproducible/odix.py", FOLD_FAILS),
    Need(f"{_IR}:WalkOrder", "reproducible/odix.py (the register resets' order)", PATCHES["odix order"], bytes=True),
    Need("coreai._compiler._mlir_libs._coreaiIR._bindings.compiler:copy_constant_value_to_array", "constant_fold",
         FOLD_FAILS),
    Need("coreai.runtime:AIModel.load", "runtime.DecodeSession", RUNTIME_FAILS),
    Need("coreai.runtime:NDArray", "runtime.DecodeSession", RUNTIME_FAILS),
    Need("coreai_opt.quantization:Quantizer", "quantize._quantizer", QUANT_FAILS),
    Need("coreai_opt.quantization:QuantizerConfig.from_dict", "quantize._quantizer", QUANT_FAILS),
    Need("coreai_opt:ExportBackend.CoreAI", "quantize._finalize", QUANT_FAILS),
)


def contract() -> list[Need]:
    """The toolchain contract: the public API, then every internal a reproducible patch touches."""
    from recurrent_coreai.coreai.reproducible.patches import ASSUMPTIONS

    return [*PUBLIC, *(Need(a.target, f"reproducible patch: {a.patch}", a.degrades, "internal", a.bytes, a.check,
                            a.text) for a in ASSUMPTIONS)]


# -- the static lookup: a module's file read, nothing imported --------------------------------------

NATIVE = object()  # a compiled module: its attributes cannot be read without loading it


def _module_source(module: str):
    """The file of ``module`` (a Path), :data:`NATIVE`, or None when there is none; nothing imported."""
    parts = module.split(".")
    spec = importlib.util.find_spec(parts[0])  # a top-level name is found without importing anything
    if spec is None:
        return None
    if not spec.submodule_search_locations:
        return (Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else NATIVE) if len(parts) == 1 \
            else None
    path = Path(spec.submodule_search_locations[0])
    for i, part in enumerate(parts[1:], 1):
        if (path / part / "__init__.py").is_file() or ((path / part).is_dir() and not (path / part / "__init__.pyi").is_file()):
            path = path / part  # a package (or a namespace package)
        elif (path / f"{part}.py").is_file():
            return path / f"{part}.py" if i == len(parts) - 1 else None
        elif any(path.glob(f"{part}.*.so")) or (path / f"{part}.pyi").is_file() or (path / part).is_dir():
            return NATIVE  # a compiled module, or one with only stubs: built by native code when loaded
        else:
            return None
    init = path / "__init__.py"
    return init if init.is_file() else NATIVE


def _bindings(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module or class body binds (into if/try/with blocks too): name -> the statement."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        out[name.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                out[(alias.asname or alias.name).split(".")[0]] = node
        for block in ("body", "orelse", "finalbody", "handlers"):
            if isinstance(node, (ast.If, ast.Try, ast.With)) and isinstance(getattr(node, block, None), list):
                inner = [s for h in node.handlers for s in h.body] if block == "handlers" else getattr(node, block)
                out.update(_bindings(inner))
    return out


@functools.lru_cache(maxsize=None)
def _parsed(source: Path, mtime_ns: int, size: int) -> ast.Module:
    """A module file's syntax tree, parsed once per process and version of the file (the
    contract's 40 targets read 25 files 58 times)."""
    del mtime_ns, size  # the cache key: a file changed on disk is parsed again
    return ast.parse(source.read_text(encoding="utf-8", errors="replace"))


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


def static_missing(target: str, _depth: int = 0) -> str | None:
    """Why ``target`` is not there, read from the package's files without importing it, or None
    when it is there or cannot be told statically (a compiled module, an inherited attribute, a
    module ``__getattr__``)."""
    module, _, attrs = target.partition(":")
    source = _module_source(module)
    if source is None:
        return f"no module {module}"
    names = [n for n in attrs.split(".") if n]
    if source is NATIVE or not names or _depth > 8:
        return None
    stat = source.stat()
    body, path, owner = _parsed(source, stat.st_mtime_ns, stat.st_size).body, module, None
    for i, name in enumerate(names):
        bound = _bindings(body)
        node = bound.get(name)
        if node is None:
            if i == 0:
                stars = [n for n in body if isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names)]
                for star in stars:
                    if static_missing(f"{_absolute(module, star, source.name == '__init__.py')}:"
                                      f"{'.'.join(names)}", _depth + 1) is None:
                        return None
                if "__getattr__" in bound:
                    return None
            elif isinstance(owner, ast.ClassDef) and owner.bases:
                return None  # maybe inherited
            return f"no attribute {path}.{name}"
        if isinstance(node, ast.ImportFrom):  # bound by an import: look where it comes from
            alias = next(a for a in node.names if (a.asname or a.name) == name)
            origin = _absolute(module, node, source.name == "__init__.py")
            if _module_source(f"{origin}.{alias.name}") is not None:  # a submodule
                return static_missing(f"{origin}.{alias.name}:{'.'.join(names[i + 1:])}", _depth + 1)
            return static_missing(f"{origin}:{'.'.join([alias.name, *names[i + 1:]])}", _depth + 1)
        if not isinstance(node, ast.ClassDef):
            return None  # a function, a value or a plain import: what it holds is not read statically
        owner, body, path = node, node.body, f"{path}.{name}"
    return None


# -- checking it ------------------------------------------------------------------------------------

def check(live: bool = True) -> list[dict]:
    """The contract's misses on the installed packages (as :func:`.reproducible.patches.miss`
    gives them). ``live`` imports the packages and runs every internal's assumption check;
    otherwise only the targets are looked up in the packages' files."""
    from recurrent_coreai.coreai.reproducible.patches import miss, target_missing

    def missing(target: str) -> str | None:
        return target_missing(target) if live else static_missing(target)

    out = []
    for need in contract():
        why = missing(need.target)
        if why is None and live and need.check is not None:
            try:
                why = None if need.check() else f"changed: NOT TRUE ANY MORE: {need.text}"
            except Exception as exc:  # noqa: BLE001 - a changed internal is what we report
                why = f"changed: NOT TRUE ANY MORE: {need.text} ({type(exc).__name__}: {exc})"
        if why is not None:
            fallback = need.or_else and not any(missing(t) for t in need.or_else)
            out.append(miss(need.target, why, need.instead if fallback else need.degrades, need.bytes, need.text)
                       | {"kind": need.kind})
    return out


def miss_line(m: dict) -> str:
    """One miss in one line: the package and version, what is missing, what degrades."""
    return " ".join(f"toolchain contract: {m['package']} {m['version']}: {m['why']} -- degrades: {m['degrades']}"
                    .split())


def miss_lines(misses: list[dict]) -> list[str]:
    """:func:`miss_line` of each miss, each line once (two entries of one missing module read alike)."""
    return list(dict.fromkeys(miss_line(m) for m in misses))


def degraded_fields(misses: list[dict]) -> dict:
    """What a record (export.json) adds when the reproducible-build patches did not all apply:
    nothing on a toolchain they fit."""
    if not misses:
        return {}
    return {"byte_reproducible": not any(m["bytes"] for m in misses), "toolchain_misses": misses}


def main(argv: list[str] | None = None) -> int:
    """``python -m recurrent_coreai.coreai.contract [--static] [--json]``: the contract's misses on
    the installed packages, one line each (exit 0: a miss degrades the build, it does not stop it)."""
    ap = argparse.ArgumentParser(prog="python -m recurrent_coreai.coreai.contract",
                                 description="check the toolchain contract against the installed coreai-* packages")
    ap.add_argument("--static", action="store_true", help="read the packages' files; import nothing")
    ap.add_argument("--json", action="store_true", help="one JSON object: versions, checked, misses")
    ns = ap.parse_args(argv)
    misses = check(live=not ns.static)
    if ns.json:
        print(json.dumps({"versions": versions(), "checked": len(contract()), "misses": misses}, sort_keys=True))
    else:
        for line in miss_lines(misses):
            print(line)
        print(f"toolchain contract: {len(contract()) - len(misses)}/{len(contract())} hold "
              f"({', '.join(f'{p} {v}' for p, v in versions().items() if p.startswith('coreai'))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
