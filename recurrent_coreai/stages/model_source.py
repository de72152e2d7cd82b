"""What the stages that read a model's normalised source share: the model's family (the config
names it) and the source directory, its manifest checked first (the source stage's bytes, as it
recorded them)."""

from __future__ import annotations

from pathlib import Path

from recurrent_coreai import families
from recurrent_coreai.pipeline.records import read_manifest


def family_and_source(settings: dict, model: str, source: str | Path):
    """(the family of ``model`` in the settings, the checked ``source`` directory as a Path)."""
    family = families.get(settings["models"][model]["family"])
    read_manifest(Path(source))
    return family, Path(source)
