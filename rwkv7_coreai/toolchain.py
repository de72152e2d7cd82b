"""Versions of everything that shapes a bundle; part of every export's and gate's record."""

from __future__ import annotations

import importlib.metadata
import platform

PACKAGES = ("torch", "coreai-core", "coreai-torch", "coreai-opt", "safetensors", "huggingface-hub", "numpy")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


def code_fingerprint() -> str:
    """sha256 over the package's code, templates and schemas (content, not mtimes): a change
    reruns the toolchain stage in Snakemake (params) and DVC (deps), and so every export."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def record() -> dict:
    return {"versions": versions(), "code_sha256": code_fingerprint()}
