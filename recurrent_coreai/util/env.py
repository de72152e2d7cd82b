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
# The one list of credentials. The Hub token, in the order huggingface_hub reads it; then every
# variable holding a secret or naming one (never printed, never written, and stripped from the
# environment of a beta-watch rebuild, which must never publish): the Hub tokens, a misspelling
# some CI systems set, the signing key's path and its password (old names included).
HUB_TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
RECORD_KEY_VAR = "RECURRENT_COREAI_RECORD_KEY"  # the key of the records' MACs (pipeline/records.py)
SECRET_VARS = (*HUB_TOKEN_VARS, "HUGGINGFACE_HUB_TOKEN", "RECURRENT_COREAI_SIGNING_KEY",
               "RECURRENT_COREAI_SIGNING_KEY_PASSWORD", "RWKV7_SIGNING_KEY", "RWKV7_SIGNING_KEY_PASSWORD",
               RECORD_KEY_VAR)
_warned: set[str] = set()


def hub_token() -> str | None:
    """The Hub token from the environment (:data:`HUB_TOKEN_VARS`, first set wins), or None."""
    return next((os.environ[v] for v in HUB_TOKEN_VARS if os.environ.get(v)), None)


def record_key() -> bytes | None:
    """The key of the records' MACs (:data:`RECORD_KEY_VAR`), or None where it is unset: records
    are then sealed with a plain digest, as before the key existed. Set but empty (or blank) is
    an error, not "no key": that is what an unset CI secret expands to, and the MAC would be off
    with no word. Never printed, never written."""
    value = os.environ.get(RECORD_KEY_VAR)
    if value is not None and not value.strip():
        from recurrent_coreai.util.errors import PipelineError

        raise PipelineError(RECORD_KEY_VAR, "is set but empty: records would be sealed and checked without a MAC",
                            f"set it to the key (an unset CI secret expands to an empty value), or unset it "
                            f"(unset {RECORD_KEY_VAR}) to seal without one")
    return value.encode() if value else None


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
