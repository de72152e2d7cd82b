"""The records stages leave beside their outputs, read back by the stages after them.

* ``manifest.json`` in ``results/<m>/source/``: the source URI, revision, layout, geometry, files.
* ``export.json`` in ``results/<m>/export/<recipe>/``: recipe, bundle, states, quantisation plan, files.
* ``aot.json`` in ``results/<m>/aot/<target>/<recipe>/``: the digests of the bundle it was built
  from (``from``) and of every file it wrote (``files``, relative to that directory).
* the gate JSON: the verdict, and ``tested_files`` (what the gate ran).
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import PipelineError
from .fsutil import first_difference, tree_manifest

MANIFEST = "manifest.json"
EXPORT = "export.json"
AOT = "aot.json"


def load_json(path: Path, fix: str = "rerun the stage that writes it") -> dict:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise PipelineError(path, "missing", fix) from None
    except json.JSONDecodeError as exc:
        raise PipelineError(path, f"invalid JSON ({exc.msg} at line {exc.lineno})", fix) from None


def read_export(export_dir: Path) -> dict:
    return load_json(Path(export_dir) / EXPORT, "rerun the export stage (snakemake --forcerun export)")


def read_aot(aot_dir: Path) -> dict:
    """``aot.json``, checked against the files beside it."""
    record = load_json(Path(aot_dir) / AOT, "rerun the aot stage (snakemake --forcerun aot)")
    on_disk = {rel: v for rel, v in tree_manifest(aot_dir).items() if rel != AOT}
    bad = first_difference(on_disk, record["files"])
    if bad:
        raise PipelineError(Path(aot_dir) / bad, "differs from what the aot stage wrote (aot.json)",
                            "rerun the aot stage: snakemake --forcerun aot")
    return record


def by_recipe(paths: list[Path], name: str | None = None) -> dict[str, dict]:
    """Records (``export.json`` in each dir, or gate JSON files) keyed by the recipe they name."""
    records = [load_json(Path(p) / name if name else Path(p)) for p in paths]
    return {r["recipe"]: r for r in records}


def read_manifest(source_dir: Path) -> dict:
    return load_json(Path(source_dir) / MANIFEST, "run the source stage first")
