"""Versions of everything that shapes a bundle; part of every export's and gate's record. (What
the pipeline needs of the coreai-* packages, and checking it: :mod:`.contract`.)"""

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


def record() -> dict:
    """What the toolchain stage writes (results/toolchain.json). The code each stage runs is
    fingerprinted per stage instead (fingerprint.py), so editing one stage reruns only it."""
    return {"versions": versions()}
