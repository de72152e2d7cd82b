"""config.yaml ``beta_watch:`` over the defaults, then the command line's overrides, checked
against the same schema the config is validated with (recurrent_coreai/pipeline/schemas)."""

from __future__ import annotations

import math
import re

from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.util.errors import PipelineError

# the values without a `beta_watch:` section (the schema validates one when present)
DEFAULTS = {
    "packages": ["coreai-core", "coreai-torch", "coreai-opt"],
    "index_url": None,  # None: pip's configured index (PyPI unless pip.conf says otherwise)
    "limits": {
        "max_agree_drop": 0.0,  # top-1 agreement outside near-ties may drop by at most this fraction
        "max_dlogits_factor": 2.0,  # new max|dlogits| <= factor x max(old, dlogits_floor)
        "dlogits_floor": 1.0e-4,  # below this an fp32 bundle's max|dlogits| is rounding noise
    },
}


def _section_schema() -> dict:
    return cfgmod.schema()["properties"]["beta_watch"]["properties"]


def _limit(item: str, ranges: dict) -> tuple[str, float]:
    key, sep, value = item.partition("=")
    if not sep or key not in DEFAULTS["limits"]:
        raise PipelineError("--limits", f"{item!r} is not KEY=VALUE with KEY one of {sorted(DEFAULTS['limits'])}",
                            "write e.g. --limits max_dlogits_factor=1.5")
    try:
        number = float(value)
    except ValueError:
        raise PipelineError("--limits", f"{key}={value!r} is not a number", "give a number") from None
    low, high = ranges[key].get("minimum"), ranges[key].get("maximum")
    span = f"{low:g}..{high:g}" if high is not None else f"at least {low:g}"
    if not math.isfinite(number) or number < low or (high is not None and number > high):
        raise PipelineError("--limits", f"{key}={value} is out of range (a finite number, {span})",
                            f"give {key} a number {span}")
    return key, number


def settings(cfg: dict, overrides: list[str] = ()) -> dict:
    """``beta_watch:`` from the config over DEFAULTS, then ``--limits KEY=VALUE`` overrides."""
    own = cfg.get("beta_watch") or {}
    out = {**DEFAULTS, **{k: v for k, v in own.items() if k != "limits"}}
    out["limits"] = {**DEFAULTS["limits"], **(own.get("limits") or {})}
    ranges = _section_schema()["limits"]["properties"]
    out["limits"].update(_limit(item, ranges) for item in overrides)
    return out


def check_index_url(url: str) -> str:
    """``--index-url`` as the config's ``beta_watch.index_url`` must be (http(s):// or file://)."""
    if not url.strip():
        raise PipelineError("--index-url", "is empty", "give the simple index's URL, e.g. https://pypi.org/simple, "
                            "or leave --index-url out for beta_watch.index_url / pip's index")
    if not re.match(_section_schema()["index_url"]["pattern"], url):
        raise PipelineError("--index-url", f"{url!r} is not an http://, https:// or file:// URL",
                            "give the simple index's URL, e.g. https://pypi.org/simple")
    return url
