"""Byte-reproducible Core AI exports and universal lowerings (coreai-core 1.0.0b3).

Every patch of coreai-* internals lives in this package, scoped by a context manager and undone
on exit. What made two builds of identical weights differ, and what removes it (one module each):

* op-name suffixes (``layer_norm_ppcmsyzh``): ``secrets.choice`` imported as ``choice`` into
  ``coreai.authoring.{graph_builder,func,metal}``; the ``secrets.randbits(64)`` default of
  ``record_id`` in ``coreai._compiler.dialects.debuginfo.ops.record``; ``uuid4`` in
  ``coreai_torch.externalize``. Within :func:`export_scope` they draw from a ``random.Random``
  seeded from the bundle's name through :data:`EXPORT_SEED` (str seeds are hashed with SHA-512,
  not ``hash()``, so PYTHONHASHSEED does not matter).  -- :mod:`.scopes`
* ``resource_<n>`` weight-blob names, made from a load address (ASLR): renamed in resource-section
  order right after coreai writes ``main.mlirb``.  -- :mod:`.bytecode`
* ``metadata.json`` key order: a Swift dictionary, deterministic only with
  ``SWIFT_DETERMINISTIC_HASHING=1`` in the environment when ``libswiftCore`` loads.  -- :mod:`.swift`
* the universal ``.odix``: the register resets that end each region, and (with ``main`` +
  ``prefill``) the function table, both in an order native code picks; put in a canonical order
  within :func:`lowering_scope`.  -- :mod:`.odix`

Memory, not bytes: within :func:`export_scope` ``save_asset`` hashes the ``main.mlirb`` it wrote in
chunks instead of reading it whole (:mod:`.chunked_hash`); :func:`constants_released` lets a
conversion free each weight's torch storage as soon as coreai-torch has copied it into a constant.

:mod:`.patches` names the patch sites and lists in :data:`ASSUMPTIONS` every fact about coreai's
internals the patches rely on; ``tests/test_reproducible.py`` checks each against the installed
coreai and fails with its text when an upgrade breaks one. On a coreai where one does not hold (a
new beta), the patch is skipped, never the build: the scopes record the miss
(:func:`collect_misses`; export.json says the bundle is not byte-reproducible and why) and warn in
one line. The whole toolchain contract (these internals and the public API the pipeline calls) is
stated in ``recurrent_coreai/coreai/contract.py``.
"""

from __future__ import annotations

from recurrent_coreai.coreai.reproducible.swift import (SWIFT_HASHING_ENV, libswiftcore,  # first: sets the env
                                                         swift_hashing_deterministic,
                                                         warn_unless_swift_hashing_deterministic)
from recurrent_coreai.coreai.reproducible.patches import (ASSET, ASSUMPTIONS, CHOICE_SITES, CONVERTER, DEBUGINFO_OPS,
                                                           EXTERNALIZE, PATCHES, Assumption, ToolchainChanged,
                                                           assumption, broken, collect_misses, patch_misses, swap,
                                                           swap_kwdefault, target_missing, toolchain_changed,
                                                           warn_misses)
from recurrent_coreai.coreai.reproducible.bytecode import (MAGIC, RESOURCE_NAME, SECTION_RESOURCE_OFFSET,
                                                            SECTION_STRING, canonicalize_resource_names, sections)
from recurrent_coreai.coreai.reproducible.chunked_hash import HASH_CHUNK, ChunkedHashlib, Unread
from recurrent_coreai.coreai.reproducible.odix import (ODIX_HEADER, ODIX_MAGIC, canonicalize_function_table,
                                                        canonicalize_register_resets, function_names)
from recurrent_coreai.coreai.reproducible.scopes import EXPORT_SEED, constants_released, export_scope, lowering_scope

__all__ = [
    "ASSET", "ASSUMPTIONS", "Assumption", "CHOICE_SITES", "PATCHES", "ToolchainChanged", "broken", "collect_misses",
    "patch_misses", "target_missing", "warn_misses", "CONVERTER", "DEBUGINFO_OPS", "EXPORT_SEED", "EXTERNALIZE", "HASH_CHUNK",
    "MAGIC", "ODIX_HEADER", "ODIX_MAGIC", "RESOURCE_NAME", "SECTION_RESOURCE_OFFSET", "SECTION_STRING",
    "SWIFT_HASHING_ENV", "ChunkedHashlib", "Unread", "assumption", "canonicalize_function_table",
    "canonicalize_register_resets", "canonicalize_resource_names", "constants_released", "export_scope",
    "function_names", "libswiftcore", "lowering_scope", "sections", "swap", "swap_kwdefault",
    "swift_hashing_deterministic", "toolchain_changed", "warn_unless_swift_hashing_deterministic",
]
