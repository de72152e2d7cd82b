"""State files: a bundle's states after some tokens, saved to resume from later.

A no-KV model's whole context is its fixed-size states: saving them after a (system) prompt and
loading them into a fresh session continues exactly where the first one stopped
(``generate --save-state`` / ``--load-state``; docs/tools.md#state-files).

The format is safetensors. Each tensor is one state of the bundle under the bundle's state name
(``export.json`` ``functions.main.states``, the runner contract's ``states``), in the bundle's
shape (batch dimension included) and dtype. The header's ``__metadata__`` (strings)
says what the states belong to:

=====================  ================================================================
``format``             ``recurrent-coreai-state/1``
``model``              the model (config.yaml ``models.<m>``)
``recipe``             the recipe of the bundle
``bundle_sha256``      the gate's digest of the ``.aimodel``'s files (``gate.json``
                       ``bundle_sha256``; the runner contract's ``bundle_sha256``)
``tokenizer_sha256``   the digest of the vocab stage's files (the runner contract's
                       ``tokenizer.sha256``): token ids mean the same text
``tokens``             how many tokens the states hold (a decimal integer, at least 1)
=====================  ================================================================

A state that does not fit the bundle -- another model, recipe or bundle, another tokenizer,
missing or extra states, another dtype or shape, non-finite values, a damaged or truncated file --
is refused in one line naming the file, before any state of the session changes.

From Python::

    from recurrent_coreai.coreai import state_file
    ident = state_file.Identity(model, recipe, bundle_sha256, tokenizer_sha256)
    state_file.save("sys.state", session.state_arrays(), ident, tokens=len(prompt))
    arrays, tokens = state_file.load("sys.state", ident, session.state_shapes, session.state_dtype)
    session.set_states(arrays)

(``tools/generate.py`` ``save_state`` / ``load_state`` do this for a session ``open_bundle`` made.)
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import atomic_path

FORMAT = "recurrent-coreai-state/1"
FIX_OTHER = "load it into the bundle it was saved from, or save a new state with this bundle (generate --save-state)"
FIX_DAMAGED = "save the state again (generate --save-state); the file is damaged"


@dataclass(frozen=True)
class Identity:
    """What a state belongs to: the states mean nothing to another bundle or tokenizer."""

    model: str
    recipe: str
    bundle_sha256: str
    tokenizer_sha256: str

    def header(self, tokens: int) -> dict[str, str]:
        return {"format": FORMAT, "model": self.model, "recipe": self.recipe, "bundle_sha256": self.bundle_sha256,
                "tokenizer_sha256": self.tokenizer_sha256, "tokens": str(int(tokens))}


def save(path: str | Path, states: Mapping[str, np.ndarray], identity: Identity, tokens: int) -> Path:
    """Write ``states`` (name -> array, as ``DecodeSession.state_arrays()`` gives them) after
    ``tokens`` tokens; atomically (a failed write leaves no file that looks complete)."""
    from safetensors.numpy import save as st_save

    if int(tokens) < 1:
        raise ValueError(f"a state holds at least one token, not {tokens}")
    data = st_save({n: np.ascontiguousarray(a) for n, a in states.items()}, metadata=identity.header(tokens))
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return path


def _describe(arrays: Mapping[str, np.ndarray]) -> str:
    return ", ".join(f"{n} {a.dtype} {list(a.shape)}" for n, a in sorted(arrays.items())) or "none"


def read(path: str | Path) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """(header metadata, arrays) of a state file, unchecked against any bundle; a file that is
    not a complete safetensors file of this format is refused in one line."""
    from safetensors import SafetensorError
    from safetensors.numpy import load as st_load

    path = Path(path)
    if not path.is_file():
        raise PipelineError(path, "no such state file", "give the file generate --save-state wrote")
    data = path.read_bytes()
    try:
        arrays = st_load(data)
        (n,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
    except (SafetensorError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise PipelineError(path, f"is not a complete safetensors state file ({str(exc).splitlines()[0][:120]})",
                            FIX_DAMAGED) from None
    if meta.get("format") != FORMAT:
        raise PipelineError(path, f"is not a state file of this format (its header names format "
                            f"{meta.get('format')!r}, not {FORMAT!r})", "give a file generate --save-state wrote")
    return meta, arrays


def load(path: str | Path, identity: Identity, shapes: Mapping[str, tuple[int, ...]],
         dtype: np.dtype) -> tuple[dict[str, np.ndarray], int]:
    """(the states, the number of tokens they hold) of a state file that fits the bundle
    ``identity`` names, whose states are ``shapes`` in ``dtype``; anything else is one line."""
    meta, arrays = read(path)
    for key in ("model", "recipe"):
        if meta.get(key) != getattr(identity, key):
            raise PipelineError(path, f"holds a state of {meta.get('model')}/{meta.get('recipe')}, not of "
                                f"{identity.model}/{identity.recipe}", FIX_OTHER)
    if meta.get("bundle_sha256") != identity.bundle_sha256:
        raise PipelineError(path, f"was saved from another bundle of {identity.model}/{identity.recipe} (bundle sha256 "
                            f"{str(meta.get('bundle_sha256'))[:12]}, this one {identity.bundle_sha256[:12]}): a rebuilt "
                            "bundle's states need not mean the same", FIX_OTHER)
    if meta.get("tokenizer_sha256") != identity.tokenizer_sha256:
        raise PipelineError(path, f"was saved with another tokenizer (sha256 {str(meta.get('tokenizer_sha256'))[:12]}, "
                            f"this bundle's {identity.tokenizer_sha256[:12]})", FIX_OTHER)
    tokens = meta.get("tokens", "")
    if not tokens.isdigit() or int(tokens) < 1:
        raise PipelineError(path, f"names {tokens!r} tokens, not a positive count", FIX_DAMAGED)
    want = {n: (tuple(s), np.dtype(dtype)) for n, s in shapes.items()}
    have = {n: (tuple(a.shape), a.dtype) for n, a in arrays.items()}
    if set(have) != set(want):
        raise PipelineError(path, f"holds states {sorted(have)}, the bundle has {sorted(want)}", FIX_OTHER)
    for n, (shape, dt) in sorted(want.items()):
        if have[n][1] != dt:
            raise PipelineError(path, f"state {n} is {have[n][1]}, the bundle's is {dt} (a state of another recipe?)",
                                FIX_OTHER)
        if have[n][0] != shape:
            raise PipelineError(path, f"state {n} has shape {list(have[n][0])}, the bundle's {list(shape)}", FIX_OTHER)
        if not np.isfinite(arrays[n]).all():
            bad = int(np.count_nonzero(~np.isfinite(arrays[n])))
            raise PipelineError(path, f"state {n} holds {bad} non-finite values (NaN or infinite)", FIX_DAMAGED)
    return arrays, int(tokens)
