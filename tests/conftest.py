"""Shared fixtures: the repo root, the validated config, a tiny synthetic source."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def cfg():
    from rwkv7_coreai import config

    return config.load(ROOT / "config.yaml")


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory, cfg) -> Path:
    """results/<model>/source for the default tiny model, built once per session."""
    from rwkv7_coreai.source import build_source

    out = tmp_path_factory.mktemp("tiny") / "source"
    build_source("rwkv7-tiny", cfg["models"]["rwkv7-tiny"], cfg["vocab"], out)
    return out


@pytest.fixture(scope="session")
def world_vocab(cfg) -> dict[int, bytes]:
    from rwkv7_coreai import vocab

    v = cfg["vocab"]
    return vocab.parse_world_vocab(vocab.package_vocab(v["package"], v["version"], v["file"], v["sha256"]))
