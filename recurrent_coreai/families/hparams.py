"""One reader of a checkpoint's ``config.json`` for every family (the idea of llama.cpp's
``find_hparam``: a value may be spelled several ways; optional ones have a default; each is typed).

Every problem is ONE :class:`~recurrent_coreai.util.errors.PipelineError` line naming the file
(``where``) and the key. The API, for a family's ``geometry.py``::

    from recurrent_coreai.families.hparams import HParams

    r = HParams(cfg, where, fix="use the config.json of an fla/HF RWKV-7 checkpoint",
                port="RWKV-7", port_fix="use a plain RWKV-7 checkpoint (or extend families/rwkv7)")
    #   cfg not a JSON object -> "is a JSON array, not an object" (fix)
    r.whole("num_hidden_layers", "n_layer")     # positive integer (2.0 reads as 2); required
    r.whole("head_dim", default=64)             # optional: absent or null -> 64
    r.number("norm_eps", "layer_norm_epsilon", default=1e-5)   # positive finite number -> float
    r.flag("tie_word_embeddings", default=False)                # true or false
    r.require("use_bias", lambda v: v is False, False, "use_bias false")
    #   a value the port does not implement: "use_bias is true; this RWKV-7 port supports only
    #   use_bias false" (port_fix); absent or null -> the default, which is then checked
    r.value("model_type", default=None)         # the raw value (absent or null -> the default)
    r.has("intermediate_size")                  # present and not null (any spelling)
    r.only(ALLOWED, what="mamba_ssm config key")   # "unknown mamba_ssm config key 'x'"
    s = r.section("ssm_cfg")                    # a nested object (absent -> {}; else it must be
    #   an object); its keys are named "ssm_cfg.<key>" in every message

Rules, the same for every family:

* several spellings (``r.whole("n_layer", "num_hidden_layers")``): the first one present with a
  value (not null) is read, and a message names that spelling; a missing required value names
  them all (``missing key 'n_layer' (or 'num_hidden_layers')``);
* a required key that is absent is ``missing key 'k'`` (the reader's ``fix``); present but null,
  or of the wrong type or range, is ``k must be a positive integer, got null`` (fix ``fix k in
  config.json``);
* an optional key that is absent or null takes its default (the default itself is not checked
  by ``whole``/``number``/``flag``, but is by ``require``).

:func:`json_type` names a JSON value's type; :func:`json_float` reads a number in any spelling
config.json writers use (transformers' ``{"__float__": "Infinity"}`` too).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from recurrent_coreai.util.errors import PipelineError

REQUIRED: Any = object()   # the default of a key that must be there
_ABSENT: Any = object()

# transformers >= 5 writes a float JSON has no literal for as a tagged object (PreTrainedConfig's
# _encode_special_floats: {"__float__": "Infinity"}) and reads back exactly these tags
FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type (``array``, ``string``, ``boolean``, ``null``, ``object`` ...)."""
    return {list: "array", str: "string", bool: "boolean", type(None): "null", dict: "object"}.get(
        type(value), type(value).__name__)


def json_float(x: object) -> float | None:
    """A number of config.json in any spelling its writers use: a JSON number (Python's json writes
    infinity as the bare token ``Infinity``; ``1e309`` reads as infinity too) or transformers'
    ``{"__float__": "Infinity"}``. None for anything else (a string, a boolean ...)."""
    if type(x) in (int, float):
        return float(x)
    if isinstance(x, Mapping) and set(x) == {"__float__"} and isinstance(x["__float__"], str):
        return FLOAT_TAGS.get(x["__float__"])
    return None


class HParams:
    """Typed access to a parsed config.json object (see the module docstring)."""

    def __init__(self, cfg: object, where: str | Path, fix: str, port: str | None = None,
                 port_fix: str | None = None, prefix: str = ""):
        if not isinstance(cfg, Mapping):
            raise PipelineError(where, f"{prefix.rstrip('.') + ' ' if prefix else ''}is a JSON {json_type(cfg)}, "
                                "not an object", fix)
        self.cfg, self.where, self.fix, self.prefix = cfg, where, fix, prefix
        self.port, self.port_fix = port, port_fix or fix

    # --- finding a value ----------------------------------------------------------------------
    def _find(self, keys: tuple[str, ...]) -> tuple[str, object]:
        """(the spelling read, its value): the first spelling with a value; else the first present
        (null), else the first spelling and _ABSENT."""
        if not keys:
            raise TypeError("name at least one key")
        for key in keys:
            if self.cfg.get(key) is not None:
                return key, self.cfg[key]
        return next(((k, None) for k in keys if k in self.cfg), (keys[0], _ABSENT))

    def _named(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def _get(self, keys: tuple[str, ...], default: object) -> tuple[str, object, bool]:
        """(spelling, value, whether it is the default)."""
        key, value = self._find(keys)
        if value is _ABSENT and default is REQUIRED:
            also = "".join(f" (or {self._named(k)!r})" for k in keys[1:])
            raise PipelineError(self.where, f"missing key {self.prefix}{keys[0]!r}{also}", self.fix)
        if value is _ABSENT or (value is None and default is not REQUIRED):
            return key, default, True
        return key, value, False

    def _bad(self, key: str, want: str, value: object) -> PipelineError:
        return PipelineError(self.where, f"{self._named(key)} must be {want}, got {json.dumps(value)}",
                             f"fix {self._named(key)} in config.json")

    def has(self, *keys: str) -> bool:
        """Whether a spelling of the key is present with a value (not null)."""
        return any(self.cfg.get(k) is not None for k in keys)

    def value(self, *keys: str, default: object = None) -> object:
        """The raw value (absent or null: ``default``)."""
        return self._get(keys, default)[1]

    # --- typed values -------------------------------------------------------------------------
    def whole(self, *keys: str, default: object = REQUIRED) -> int:
        """A positive integer (an integral float such as 2.0 reads as 2)."""
        key, v, given = self._get(keys, default)
        if given:
            return v  # type: ignore[return-value]
        if not (type(v) is int or (type(v) is float and v.is_integer())) or v <= 0:
            raise self._bad(key, "a positive integer", v)
        return int(v)

    def number(self, *keys: str, default: object = REQUIRED) -> float:
        """A positive finite number, as a float."""
        key, v, given = self._get(keys, default)
        if given:
            return v  # type: ignore[return-value]
        if type(v) not in (int, float) or not 0 < v < math.inf:
            raise self._bad(key, "a positive number", v)
        return float(v)

    def flag(self, *keys: str, default: object = REQUIRED) -> bool:
        """true or false."""
        key, v, given = self._get(keys, default)
        if given:
            return v  # type: ignore[return-value]
        if not isinstance(v, bool):
            raise self._bad(key, "true or false", v)
        return v

    def require(self, key: str | tuple[str, ...], ok: Callable[[object], bool], default: object, want: str) -> object:
        """A setting the port implements only one way: ``ok(value)`` must hold (absent or null: the
        default, checked too); otherwise ``k is <value>; this <port> port supports only <want>``."""
        keys = (key,) if isinstance(key, str) else tuple(key)
        spelled, v, _ = self._get(keys, default)
        if not ok(v):
            port = f"this {self.port} port" if self.port else "this port"
            raise PipelineError(self.where, f"{self._named(spelled)} is {json.dumps(v)}; {port} supports only {want}",
                                self.port_fix)
        return v

    # --- the object's keys --------------------------------------------------------------------
    def only(self, allowed: Iterable[str], what: str = "key") -> None:
        """Every key is one of ``allowed``: else ``unknown <what> <prefix>'k'`` (the first, sorted)."""
        unknown = sorted(set(self.cfg) - set(allowed))
        if unknown:
            raise PipelineError(self.where, f"unknown {what} {self.prefix}{unknown[0]!r}", self.fix)

    def section(self, key: str) -> "HParams":
        """The nested object ``key`` (absent: an empty one), its keys named ``key.<k>``."""
        value = self.cfg.get(key, {})
        if not isinstance(value, Mapping):
            raise PipelineError(self.where, f"{self._named(key)} is a JSON {json_type(value)}, not an object", self.fix)
        return HParams(value, self.where, self.fix, self.port, self.port_fix, f"{self._named(key)}.")
