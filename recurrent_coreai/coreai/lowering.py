"""The Linux lowering of a bundle's program into ODIX (a ``*-universal.odix``), on the installed coreai-core.

coreai-core 1.0.0b3 lowers with the private ``AIModelAsset._write_odix``: it reads ``main.mlirb``
into a context of its own, runs the native ``compile_to_binary`` and writes the module with
``serialize_module_to_odix``. 1.0.0b2 has neither ``_write_odix`` nor ``compile_to_binary``; its
own ``AIModelAsset.executable()`` lowers by running the pass ``define-graph-output-intents``
(``intent=return``) and the pipeline ``core-to-odix`` (:data:`FALLBACK_PASSES`) before the same
``serialize_module_to_odix``. :func:`compile_module` takes ``compile_to_binary`` where the
installed coreai-core has it and those passes where it has not (through the compiler bindings'
``apply_passes``, which both betas have), and says which it ran; the
toolchain contract (:mod:`.contract`) lists both. The names are looked up on coreai-core's asset
module at call time, so :func:`.reproducible.lowering_scope`'s serializer applies.
"""

from __future__ import annotations

import importlib
from pathlib import Path

ODIX = "main-universal.odix"
COMPILE = "compile_to_binary"
# what coreai-core 1.0.0b2's AIModelAsset.executable() runs where compile_to_binary is missing
FALLBACK_PASSES = (("define-graph-output-intents", "intent=return"), ("core-to-odix", None))
FALLBACK = "define-graph-output-intents + core-to-odix"
NATIVE = "coreai._compiler._mlir_libs._coreaiIR._bindings.compiler"  # the compiler's bindings: both betas have these


def asset_module():
    from recurrent_coreai.coreai import reproducible

    return importlib.import_module(reproducible.ASSET)


def load_program(aimodel: Path):
    """The MLIR module of ``aimodel``'s ``main.mlirb``, in a context of its own (as ``_write_odix``
    reads it: the lowering mutates it and puts weight blobs into its context)."""
    asset = asset_module()
    return asset.load_module_from_bytecode(context=asset.Context()._mlir_context,  # noqa: SLF001 - as _write_odix
                                           path=Path(aimodel) / "main.mlirb")


def compile_module(module, out_dir: Path) -> str:
    """Lower ``module`` in place for ODIX, its compiled blobs into ``out_dir``; which lowering ran:
    :data:`COMPILE` or :data:`FALLBACK`."""
    asset = asset_module()
    if callable(getattr(asset, COMPILE, None)):
        getattr(asset, COMPILE)(module=module, output_directory=out_dir, enable_debug_info=False)
        return COMPILE
    native = importlib.import_module(NATIVE)
    passes = []
    for name, options in FALLBACK_PASSES:
        entry = native.PassEntry()  # as coreai-core's own PassEntry.to_native_type builds one
        entry.pass_name = name
        if options:
            entry.options = options
        passes.append(entry)
    settings = native.Options()
    settings.output_directory = Path(out_dir)
    native.apply_passes(module=module, passes=passes, options=settings)
    return FALLBACK


def write_odix(module, out_dir: Path) -> None:
    """The lowered ``module`` as ``out_dir``/:data:`ODIX`."""
    asset_module().serialize_module_to_odix(module=module, path=Path(out_dir) / ODIX)


def lower(aimodel: Path, out_dir: Path) -> None:
    """``aimodel`` lowered into ``out_dir`` (an existing, empty ``*.aimodelx`` directory) through
    ``AIModelAsset._write_odix`` where the installed coreai-core has it, else through
    :func:`load_program`, :func:`compile_module` and :func:`write_odix`."""
    asset = asset_module()
    if callable(getattr(asset.AIModelAsset, "_write_odix", None)):
        asset.AIModelAsset.load(aimodel)._write_odix(out_dir)  # noqa: SLF001 - the Linux lowering of 1.0.0b3
        return
    module = load_program(aimodel)
    compile_module(module, out_dir)
    write_odix(module, out_dir)
