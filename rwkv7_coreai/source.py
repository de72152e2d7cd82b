"""The source stage: a checkpoint in Hugging Face layout, normalised, with a manifest.

Kinds: ``synthetic`` (seeded random init, offline default), ``path`` (a local HF-layout
directory or a BlinkDL ``.pth``), ``hf`` (huggingface_hub ``snapshot_download`` at a pinned
commit, every file verified against its content address).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from . import checkpoint, synthetic
from .config import HEX40, PLACEHOLDER_REVISION
from .errors import PipelineError
from .fsutil import atomic_path, dumps_json, git_blob_sha1, sha256_file, tree_manifest
from .geometry import Geometry
from .vocab import package_vocab

VOCAB_FILE = "rwkv_vocab_v20230424.txt"
MANIFEST = "manifest.json"
# files of an HF snapshot we carry over besides the weights (the tokenizer and the card)
CARRY = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
         "added_tokens.json", VOCAB_FILE, "README.md")


# --- hf --------------------------------------------------------------------------------------
def verify_snapshot(snapshot: Path) -> None:
    """Check every file of a huggingface_hub snapshot against the content address it is stored
    under (blob name = sha256 for LFS files, git sha1 otherwise). huggingface_hub does not."""
    for path in sorted(snapshot.rglob("*")):
        if not path.is_file():
            continue
        blob = Path(os.path.realpath(path)).name
        if len(blob) == 64:
            got, kind = sha256_file(path), "sha256"
        elif len(blob) == 40:
            got, kind = git_blob_sha1(path), "git sha1"
        else:
            continue  # not in the content-addressed cache layout (nothing to check against)
        if got != blob:
            raise PipelineError(path, f"content {kind} {got} does not match the Hub's {blob} (corrupted or truncated download)",
                                f"delete {os.path.realpath(path)} from the Hugging Face cache and run again")


def fetch_hf(repo: str, revision: str, allow_patterns: list[str] | None) -> Path:
    """Download (or reuse from the cache) a pinned snapshot; returns the snapshot directory."""
    where = f"hf://{repo}@{revision}"
    if revision == PLACEHOLDER_REVISION:
        raise PipelineError(where, "the revision is the unpinned placeholder",
                            "run `python scripts/pin_revision.py MODEL` where the Hub is reachable and commit config.yaml")
    if not HEX40.match(revision):
        raise PipelineError(where, "revision is not a full 40-hex commit hash",
                            "pin the exact commit (python scripts/pin_revision.py MODEL)")
    import httpx2  # huggingface_hub 2.4's transport; its network errors are not OSErrors
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hf_errors

    try:
        snapshot = Path(snapshot_download(repo_id=repo, revision=revision, allow_patterns=allow_patterns))
    except hf_errors.RevisionNotFoundError:
        raise PipelineError(where, "revision not found on the Hub", "check the commit hash in config.yaml") from None
    except hf_errors.RepositoryNotFoundError:
        raise PipelineError(where, "repository not found (or private without a token)",
                            "check source.repo in config.yaml, or set HF_TOKEN for a private repo") from None
    except hf_errors.LocalEntryNotFoundError:  # before EntryNotFoundError: it is a subclass
        raise PipelineError(where, "files not in the local cache and the Hub could not be reached (or a file is missing)",
                            "run once with network access, or unset HF_HUB_OFFLINE") from None
    except hf_errors.RemoteEntryNotFoundError as exc:
        raise PipelineError(where, f"a file is missing on the Hub ({_first_line(exc)})", "check allow_patterns") from None
    except (hf_errors.HfHubHTTPError, OSError, httpx2.TransportError) as exc:
        raise PipelineError(where, f"download failed ({type(exc).__name__}: {_first_line(exc)})",
                            "retry; the cache keeps what was already downloaded") from None
    if not snapshot.is_dir() or not any(snapshot.iterdir()):
        raise PipelineError(where, f"allow_patterns {allow_patterns} matched no file", "fix allow_patterns in config.yaml")
    verify_snapshot(snapshot)
    return snapshot


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# --- writing the stage output ----------------------------------------------------------------
def _copy(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)  # never link into a cache: outputs are ours to overwrite


def _write_from_dir(src: Path, out: Path) -> dict:
    """Copy an HF-layout directory into ``out`` with weights normalised; returns manifest parts."""
    if src.is_dir():
        upstream = tree_manifest(src)
    else:
        upstream = {src.name: {"sha256": sha256_file(src), "size": src.stat().st_size}}
    geom, sd = checkpoint.load_checkpoint(src)
    files = checkpoint.weight_files(src)
    layout = checkpoint.detect_layout(list(checkpoint.read_tensors(files).keys()))
    base = src if src.is_dir() else src.parent
    for name in CARRY:
        if (base / name).is_file():
            _copy(base / name, out / name)
    if layout == "fla-split" and len(files) == 1 and files[0].suffix == ".safetensors":
        _copy(files[0], out / checkpoint.WEIGHT_FILE)  # already the normal form: bytes unchanged
    else:
        checkpoint.save_normalized(sd, out / checkpoint.WEIGHT_FILE)
    if not (out / "config.json").is_file():
        (out / "config.json").write_text(dumps_json(geom.to_hf_config()))
    return {"upstream": upstream, "layout": layout, "geometry": geom.as_dict()}


def _write_synthetic(spec: dict, vocab_cfg: dict, out: Path, license_: str) -> dict:
    geom = Geometry(**spec["shape"]).check("config.yaml")
    sd = synthetic.synthetic_state_dict(geom, spec["seed"])
    layout = spec.get("layout", "fla-split")
    synthetic.write_weights(sd, out, layout)
    (out / "config.json").write_text(dumps_json(geom.to_hf_config()))
    vocab = package_vocab(vocab_cfg["package"], vocab_cfg["version"], vocab_cfg["file"], vocab_cfg["sha256"])
    _copy(vocab, out / VOCAB_FILE)
    (out / "tokenizer_config.json").write_text(dumps_json({
        "tokenizer_class": "RwkvTokenizer", "vocab_file": VOCAB_FILE, "bos_token": "<s>", "eos_token": "<s>",
        "model_max_length": 1000000000000000019884624838656}))
    (out / "README.md").write_text(
        f"---\nlicense: {license_}\npipeline_tag: text-generation\n---\n\n"
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
            # the normal form is what was written: keep one layout for the stages after us
            if parts["layout"] != "fla-split":
                geom, sd = checkpoint.load_checkpoint(tmp)
                for f in checkpoint.weight_files(tmp):
                    f.unlink()
                checkpoint.save_normalized(sd, tmp / checkpoint.WEIGHT_FILE)
        elif kind == "path":
            src = Path(spec["path"])
            if not src.exists():
                raise PipelineError(src, "source path does not exist", "fix models/<name>/source/path in config.yaml")
            parts = _write_from_dir(src, tmp)
            uri, revision = f"file://{src.resolve()}", None
        elif kind == "hf":
            snapshot = fetch_hf(spec["repo"], spec["revision"], spec.get("allow_patterns"))
            parts = _write_from_dir(snapshot, tmp)
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


def read_manifest(source_dir: Path) -> dict:
    path = Path(source_dir) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise PipelineError(path, "source manifest missing", "run the source stage first") from None
