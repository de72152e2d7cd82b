"""The source stage: a checkpoint in Hugging Face layout, normalised, with a manifest.

Kinds: ``synthetic`` (seeded random init, offline default), ``path`` (a local HF-layout
directory or a BlinkDL ``.pth``), ``hf`` (huggingface_hub ``snapshot_download`` at a pinned
commit, every file verified against its content address).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import yaml

from recurrent_coreai.families.rwkv7 import checkpoint
from recurrent_coreai.families.rwkv7 import synthetic
from recurrent_coreai.pipeline import stage
from recurrent_coreai.util.errors import PipelineError, main_guard
from recurrent_coreai.util.fsutil import atomic_path, dumps_json, sha256_file, tree_manifest
from recurrent_coreai.util.frontmatter import front_matter
from recurrent_coreai.families.rwkv7.geometry import Geometry
from recurrent_coreai.hub.download import fetch_hf
from recurrent_coreai.pipeline.records import MANIFEST
from recurrent_coreai.tokenizers.world import VOCAB_FILE, check_checkpoint_vocab, package_vocab

# files of an HF snapshot we carry over besides the weights (the tokenizer and the card)
CARRY = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
         "added_tokens.json", VOCAB_FILE, "README.md")


# --- writing the stage output ----------------------------------------------------------------
def _copy(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)  # never link into a cache: outputs are ours to overwrite


def _pinned_vocab(vocab_cfg: dict) -> Path:
    return package_vocab(vocab_cfg["package"], vocab_cfg["version"], vocab_cfg["file"], vocab_cfg["sha256"])


def _manifest_of(files: list[Path], base: Path) -> dict[str, dict]:
    return {f.relative_to(base).as_posix(): {"sha256": sha256_file(f), "size": f.stat().st_size}
            for f in sorted(set(files))}


def _write_from_dir(src: Path, out: Path, pinned_vocab: Path) -> dict:
    """Check an HF-layout directory (or a weights file) and copy it into ``out`` with its weights
    normalised to one model.safetensors; returns manifest parts. ``upstream`` lists exactly the
    files read: the weights, the shard index, config.json and the carried files."""
    ck = checkpoint.write_normalized(src, out / checkpoint.WEIGHT_FILE)  # one tensor at a time
    base = src if src.is_dir() else src.parent
    carried = [base / name for name in CARRY if (base / name).is_file()]
    if (base / "README.md").is_file():
        front_matter(base / "README.md")
    for f in carried:
        if f.name == VOCAB_FILE:
            check_checkpoint_vocab(f, pinned_vocab)
            _copy(pinned_vocab, out / VOCAB_FILE)  # the same tokens; keep the pinned bytes
        else:
            _copy(f, out / f.name)
    if not (out / "config.json").is_file():
        (out / "config.json").write_text(dumps_json(ck.geometry.to_hf_config()))
    return {"upstream": _manifest_of(ck.inputs + carried, base), "layout": ck.layout,
            "geometry": ck.geometry.as_dict()}


def _write_synthetic(spec: dict, vocab_cfg: dict, out: Path, license_: str) -> dict:
    geom = Geometry(**spec["shape"]).check("config.yaml")
    layout = spec.get("layout", "fla-split")
    if layout == "fla-split":
        synthetic.write_synthetic(geom, spec["seed"], out, layout)
    else:  # written in that layout, then normalised as a path source is: one tensor at a time
        with tempfile.TemporaryDirectory(prefix=".raw.", dir=out) as raw:
            synthetic.write_synthetic(geom, spec["seed"], Path(raw), layout)
            (Path(raw) / "config.json").write_text(dumps_json(geom.to_hf_config()))
            checkpoint.write_normalized(Path(raw), out / checkpoint.WEIGHT_FILE)
    (out / "config.json").write_text(dumps_json(geom.to_hf_config()))
    _copy(_pinned_vocab(vocab_cfg), out / VOCAB_FILE)
    (out / "tokenizer_config.json").write_text(dumps_json({
        "tokenizer_class": "RwkvTokenizer", "vocab_file": VOCAB_FILE, "bos_token": "<s>", "eos_token": "<s>",
        "model_max_length": 1000000000000000019884624838656}))
    front = yaml.safe_dump({"license": license_, "pipeline_tag": "text-generation"}, sort_keys=True, allow_unicode=True)
    (out / "README.md").write_text(
        f"---\n{front}---\n\n"
        f"Synthetic RWKV-7 (seed {spec['seed']}, random weights) in the fla/Hugging Face layout.\n")
    return {"upstream": {}, "layout": layout, "geometry": geom.as_dict()}


def build_source(model_name: str, model_cfg: dict, vocab_cfg: dict, out: Path) -> dict:
    """Write ``out`` (atomically) and return its manifest."""
    spec = model_cfg["source"]
    kind = spec["kind"]
    with atomic_path(out, directory=True) as tmp:
        if kind == "synthetic":
            parts = _write_synthetic(spec, vocab_cfg, tmp, model_cfg.get("license", "apache-2.0"))
            uri, revision = f"synthetic://{model_name}?seed={spec['seed']}", None
        elif kind == "path":
            src = Path(spec["path"])
            if not src.exists():
                raise PipelineError(src, "source path does not exist", "fix models/<name>/source/path in config.yaml")
            parts = _write_from_dir(src, tmp, _pinned_vocab(vocab_cfg))
            uri, revision = f"file://{src.resolve()}", None
        elif kind == "hf":
            snapshot = fetch_hf(spec["repo"], spec["revision"], spec.get("allow_patterns"))
            parts = _write_from_dir(snapshot, tmp, _pinned_vocab(vocab_cfg))
            uri, revision = f"hf://{spec['repo']}", snapshot.name
        else:  # the schema makes this unreachable
            raise PipelineError("config.yaml", f"unknown source kind {kind!r}", "use synthetic, path or hf")
        manifest = {
            "model": model_name,
            "source": {"kind": kind, "uri": uri, "revision": revision},
            "layout": parts["layout"],
            "normalized_to": "fla-split",
            "geometry": parts["geometry"],
            "upstream": parts["upstream"],
            "files": tree_manifest(tmp),
        }
        (tmp / MANIFEST).write_text(dumps_json(manifest))
    return manifest


@main_guard
def main(argv=None) -> int:
    """The source stage: ``scripts/source.py --model M --out DIR``."""
    ns = stage.parser("source", "model", "out").parse_args(argv)
    s, _ = stage.setup("source", ns)
    manifest = build_source(ns.model, s["models"][ns.model], s["vocab"], Path(ns.out))
    stage.log.info("source %s: %s (%s layout) -> %s, %d files", ns.model, manifest["source"]["uri"],
                   manifest["layout"], ns.out, len(manifest["files"]))
