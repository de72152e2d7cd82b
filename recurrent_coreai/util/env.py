"""Environment variables the project reads, with the old ``RWKV7_*`` names kept as aliases.

The package was ``rwkv7_coreai`` before it held three families; its variables were renamed
``RECURRENT_COREAI_*``. An old name still works (a published promise) and prints a one-time
deprecation note on stderr naming the new one.
"""

from __future__ import annotations

import os
import sys

ALIASES = {  # new name -> the old name it replaces (still read)
    "RECURRENT_COREAI_SIGNING_KEY": "RWKV7_SIGNING_KEY",
    "RECURRENT_COREAI_SIGNING_KEY_PASSWORD": "RWKV7_SIGNING_KEY_PASSWORD",
    "RECURRENT_COREAI_PROGRESS": "RWKV7_PROGRESS",
}
_warned: set[str] = set()


def get(name: str, default: str | None = None) -> str | None:
    """``$name``, else its deprecated alias (noted once on stderr), else ``default``."""
    value = os.environ.get(name)
    if value is not None:
        return value
    old = ALIASES.get(name)
    if old is not None and old in os.environ:
        if old not in _warned:
            _warned.add(old)
            print(f"note: {old} is deprecated; use {name} (the old name still works)", file=sys.stderr)
        return os.environ[old]
    return default
