"""The source stage: a checkpoint in Hugging Face layout, normalised, with a manifest.

Kinds: ``synthetic`` (seeded random init from the model's family, offline default), ``path`` (a
local HF-layout directory or a single weights file in a layout the family accepts), ``hf`` (huggingface_hub ``snapshot_download`` at a pinned
commit, every file verified against its content address).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import yaml

from recurrent_coreai import families, tokenizers
from recurrent_coreai.checkpoints import reader
from recurrent_coreai.hub.download import fetch_hf
from recurrent_coreai.pipeline import stage
from recurrent_coreai.pipeline.records import MANIFEST, write_sealed
from recurrent_coreai.util.errors import PipelineError, main_guard
from recurrent_coreai.util.frontmatter import front_matter
from recurrent_coreai.util.fsutil import why_missing, atomic_path, dumps_json, sha256_file, tree_manifest

# files of an HF snapshot we carry over besides the weights and the tokenizer's (the card)
CARRY = ("config.json", "generation_config.json", "README.md")


# --- writing the stage output ----------------------------------------------------------------
def _copy(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)  # never link into a cache: outputs are ours to overwrite


def _manifest_of(files: list[Path], base: Path) -> dict[str, dict]:
    return {f.relative_to(base).as_posix(): {"sha256": sha256_file(f), "size": f.stat().st_size}
            for f in sorted(set(files))}


def _write_from_dir(family, tok, src: Path, out: Path, tok_settings: dict) -> dict:
    """Check an HF-layout directory (or a weights file) and copy it into ``out`` with its weights
    normalised to one model.safetensors; returns manifest parts. ``tok``: the model's tokenizer kind
    (module). ``upstream`` lists exactly the files read: the weights, the shard index, config.json
    and the carried files."""
    ck = reader.write_normalized(src, out / reader.WEIGHT_FILE, family)  # one tensor at a time
    base = src if src.is_dir() else src.parent
    carried = [base / name for name in CARRY if (base / name).is_file()]
    if (base / "README.md").is_file():
        front_matter(base / "README.md")
    for f in carried:
        _copy(f, out / f.name)
    carried += tok.carry(base, out, tok_settings)
    if not (out / "config.json").is_file():
        (out / "config.json").write_text(dumps_json(family.config_json(ck.geometry)))
    return {"upstream": _manifest_of(ck.inputs + carried, base), "layout": ck.layout,
            "geometry": ck.geometry.as_dict()}


def _write_synthetic(family, tok, spec: dict, tok_settings: dict, out: Path, license_: str) -> dict:
    geom = family.geometry_from_shape(spec["shape"], "config.yaml")
    layout = spec.get("layout", family.layouts[0])
    if layout not in family.synthetic_layouts:
        raise PipelineError("config.yaml", f"source.layout {layout!r} is not one family {family.name} writes",
                            f"use one of {', '.join(family.synthetic_layouts)}")
    if layout == family.layouts[0] and family.streams(layout):
        family.write_synthetic(geom, spec["seed"], out, layout)
    else:  # written in that layout (as a user's file would be: e.g. without a tied head), then
        # normalised as a path source is: one tensor at a time where the layout allows
        with tempfile.TemporaryDirectory(prefix=".raw.", dir=out) as raw:
            family.write_synthetic(geom, spec["seed"], Path(raw), layout)
            if not (Path(raw) / "config.json").exists():
                (Path(raw) / "config.json").write_text(dumps_json(family.config_json(geom)))
            reader.write_normalized(Path(raw), out / reader.WEIGHT_FILE, family)
    (out / "config.json").write_text(dumps_json(family.config_json(geom)))
    # a synthetic tokenizer (hf-bpe, sp-bpe) is made for the model's vocabulary size; the World one is
    # pinned; the byte-level table is fixed (no files)
    try:
        tok.source_files(out, {**tok_settings, "vocab_size": geom.vocab})
    except ValueError as exc:  # the synthetic BPE trainers cannot make every size (tokenizers/bpe.py, spbpe.py)
        raise PipelineError("config.yaml", f"source.shape.vocab {geom.vocab}: the synthetic tokenizer cannot have "
                            f"exactly that many ids ({exc})", "use another vocab (1024, the synthetic tokenizer's "
                            "full size, always works)") from None
    front = yaml.safe_dump({"license": license_, "pipeline_tag": "text-generation"}, sort_keys=True, allow_unicode=True)
    (out / "README.md").write_text(
        f"---\n{front}---\n\n"
        f"Synthetic {family.display_name.split(' (')[0]} (seed {spec['seed']}, random weights) in the "
        f"{family.layouts[0]} layout.\n")
    return {"upstream": {}, "layout": layout, "geometry": geom.as_dict()}


def build_source(model_name: str, model_cfg: dict, vocab_cfg: dict, out: Path) -> dict:
    """Write ``out`` (atomically) and return its manifest. ``vocab_cfg``: the tokenizer settings
    (config.yaml ``vocab:``, the pinned World vocabulary); a checkpoint's own tokenizer pin
    (``source.tokenizer_sha256``) joins them. The tokenizer kind is the model's
    (``families.tokenizer_of``: ``models.<m>.tokenizer``, else the family's)."""
    family = families.get(model_cfg["family"])
    tok = tokenizers.kind(families.tokenizer_of(model_cfg))
    spec = model_cfg["source"]
    kind = spec["kind"]
    tok_settings = {**vocab_cfg, tokenizers.PIN: spec.get(tokenizers.PIN)}
    with atomic_path(out, directory=True) as tmp:
        if kind == "synthetic":
            parts = _write_synthetic(family, tok, spec, tok_settings, tmp, model_cfg.get("license", "apache-2.0"))
            uri, revision, where = f"synthetic://{model_name}?seed={spec['seed']}", None, "config.yaml"
        elif kind == "path":
            src = Path(spec["path"])
            if not src.exists():
                raise PipelineError(src, f"source path {why_missing(src)}", "fix models/<name>/source/path in config.yaml")
            parts = _write_from_dir(family, tok, src, tmp, tok_settings)
            # a path inside the repo (the trained fixtures) is named relative to it, so two clones build
            # the same manifest; a path elsewhere by its absolute location
            uri = f"file:{src.as_posix()}" if not src.is_absolute() else f"file://{src.resolve()}"
            revision, where = None, src
        elif kind == "hf":
            snapshot = fetch_hf(spec["repo"], spec["revision"], spec.get("allow_patterns"))
            parts = _write_from_dir(family, tok, snapshot, tmp, tok_settings)
            uri, revision, where = f"hf://{spec['repo']}", snapshot.name, snapshot
        else:  # the schema makes this unreachable
            raise PipelineError("config.yaml", f"unknown source kind {kind!r}", "use synthetic, path or hf")
        # every id the tokenizer produces has a row in the embedding and the head (tokenizers/fit.py):
        # here, the first stage that knows both, before any reference or export runs. A checkpoint's
        # tensors are named as the file names them (emb.weight of a BlinkDL .pth), a synthetic's as the
        # normal form
        geom = family.geometry_from_dict(parts["geometry"])
        rows = family.vocab_rows(geom) if kind == "synthetic" else family.stored_vocab_rows(geom, parts["layout"])
        tok.fits(tmp, tok_settings, rows, where)
        manifest = {
            "model": model_name,
            "source": {"kind": kind, "uri": uri, "revision": revision},
            "layout": parts["layout"],
            "normalized_to": family.layouts[0],
            "geometry": parts["geometry"],
            "upstream": parts["upstream"],
            "files": tree_manifest(tmp),
        }
        write_sealed(tmp / MANIFEST, manifest, "source")  # sealed: see pipeline/records.py
    return manifest


@main_guard
def main(argv=None) -> int:
    """The source stage: ``scripts/source.py --model M --out DIR``."""
    ns = stage.parser("source", "model", "out").parse_args(argv)
    s, _ = stage.setup("source", ns)
    manifest = build_source(ns.model, s["models"][ns.model], s["vocab"], Path(ns.out))
    stage.log.info("source %s: %s (%s layout) -> %s, %d files", ns.model, manifest["source"]["uri"],
                   manifest["layout"], ns.out, len(manifest["files"]))
