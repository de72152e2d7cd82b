"""The family registry: one folder per architecture, imported by name only when used.

``get("rwkv7")`` imports ``families/rwkv7/`` and returns its ``FAMILY``. Stages and tools reach a
family only through here (import-linter's contracts in pyproject.toml forbid a direct import), so
adding a family is adding a folder and a line to :data:`NAMES`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Iterable, Mapping

from recurrent_coreai.util.errors import PipelineError

NAMES = ("rwkv7", "rwkv6", "mamba2", "gdn", "mamba1")  # registered families (folders below this one)


def available() -> tuple[str, ...]:
    """The registered families whose folder exists in this checkout."""
    here = Path(__file__).resolve().parent
    return tuple(n for n in NAMES if (here / n / "__init__.py").is_file())


def get(name: str, where: str | Path = "config.yaml"):
    """The :class:`~recurrent_coreai.families.base.Family` registered as ``name``."""
    if name not in available():
        raise PipelineError(where, f"unknown model family {name!r}",
                            f"use one of {', '.join(available())} (models.<name>.family)")
    return importlib.import_module(f"{__name__}.{name}").FAMILY


def tokenizer_of(model: Mapping, where: str | Path = "config.yaml") -> str:
    """The tokenizer kind of a model (a key of ``tokenizers.KINDS``): its own ``tokenizer``
    (config.yaml ``models.<m>.tokenizer``), else its family's default (``Family.tokenizer``).
    ``model`` is the model's config, or any record holding its ``family`` (and ``tokenizer`` where
    set: the publish receipt). Every caller that picks a tokenizer kind asks this."""
    return model.get("tokenizer") or get(model["family"], where).tokenizer


def detect(names: Iterable[str]) -> list[tuple[str, str]]:
    """(family, layout) of every registered family that recognises these tensor names."""
    names = list(names)
    found = []
    for fam in available():
        layout = get(fam).detect_layout(names)
        if layout is not None:
            found.append((fam, layout))
    return found
