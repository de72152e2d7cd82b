"""The records stages leave beside their outputs, read back by the stages after them.

* ``manifest.json`` in ``results/<m>/source/``: the source URI, revision, layout, geometry, files.
* ``export.json`` in ``results/<m>/export/<recipe>/``: recipe, bundle, states, quantisation plan, files.
* ``aot.json`` in ``results/<m>/aot/<target>/<recipe>/``: the digests of the bundle it was built
  from (``from``) and of every file it wrote (``files``, relative to that directory).
* the gate JSON: the verdict, and ``tested_files`` (what the gate ran).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import first_difference, tree_manifest

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


# The export stage's summary line in its job log (``export <model>/<recipe>: <bundle>, <size> MB
# (...) in <s> s, peak RSS <mb> MB; ...``): the one record of its cost. Not in export.json, which
# holds no timings so that rebuilds are byte-identical.
EXPORT_LINE = re.compile(r"export (?P<model>[^/\s]+)/(?P<recipe>\S+): \S+, [\d.]+ MB[^;\n]* in (?P<seconds>[\d.]+) s, "
                         r"peak RSS (?P<rss_mb>[\d.]+) MB")


def export_stats(log: Path, model: str, recipe: str) -> dict | None:
    """Export time and peak RSS from the export job's log (its last summary line); None when the
    log is missing (logs are not tracked by DVC: after a ``dvc pull`` there are none) or has no
    such line."""
    try:
        text = Path(log).read_text(errors="replace")
    except FileNotFoundError:
        return None
    hits = [m for m in EXPORT_LINE.finditer(text) if m["model"] == model and m["recipe"] == recipe]
    if not hits:
        return None
    return {"seconds": float(hits[-1]["seconds"]), "rss_mb": float(hits[-1]["rss_mb"])}
