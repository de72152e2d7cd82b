"""``metadata.json`` key order: a Swift dictionary, hashed with a per-process seed unless
``SWIFT_DETERMINISTIC_HASHING=1`` is in the environment when ``libswiftCore`` loads (its global
constructor reads it). Importing this module (and ``recurrent_coreai``, which sets it first) puts
it there; :func:`swift_hashing_deterministic` reads the flag from the loaded runtime itself."""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from pathlib import Path

SWIFT_HASHING_ENV = "SWIFT_DETERMINISTIC_HASHING"  # set by recurrent_coreai/__init__.py, before coreai loads
os.environ.setdefault(SWIFT_HASHING_ENV, "1")  # effective only if libswiftCore is not loaded yet

log = logging.getLogger(__name__)


def libswiftcore() -> Path | None:
    """Where coreai's ``libswiftCore.so`` is (found without importing coreai), or None without coreai."""
    spec = importlib.util.find_spec("coreai")  # locates the package without importing (loading) it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0]) / "runtime" / "lib" / "swift" / "linux" / "libswiftCore.so"


def swift_hashing_deterministic() -> bool | None:
    """Whether the Swift runtime in this process hashes deterministically: read from its
    ``_swift_stdlib_Hashing_parameters`` (seed0, seed1, deterministic) if it is loaded, else
    from the environment it will read. None if that cannot be told (no such library/symbol)."""
    path = libswiftcore()
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


def warn_unless_swift_hashing_deterministic() -> None:
    """Log a warning when the loaded Swift runtime hashes with a random seed (metadata.json varies)."""
    if swift_hashing_deterministic() is False:
        log.warning("metadata.json key order will vary: the Swift runtime was loaded without %s=1 "
                    "(import recurrent_coreai before coreai, or set it in the environment)", SWIFT_HASHING_ENV)
