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


@pytest.fixture(autouse=True)
def _restore_logging():
    """The stage CLIs point the root logger at stdout and a log file; undo that after each test."""
    import logging

    yield
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()


@pytest.fixture(scope="module")
def one_thread():
    """Single-threaded torch: faster on the tiny shapes and deterministic reductions."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_results(tmp_path_factory, repo_root) -> Path:
    """A complete results tree for rwkv7-tiny (fp32, fp16, int8keepproj on `universal`), built by
    the stage entry points with a short gate (2 prompts, 40 steps) — what the card and publish
    tests read. Everything is real: the bundles are exported, lowered and gated here."""
    import yaml

    from rwkv7_coreai import cli

    root = tmp_path_factory.mktemp("pipeline")
    res = root / "results"
    cfg = yaml.safe_load((repo_root / "config.yaml").read_text())
    cfg["results"] = str(res)
    cfg["gate"]["prompts"] = ["Hello, who are you?", "What is 17 times 23?"]
    cfg["gate"]["steps"] = 40
    conf = root / "config.yaml"
    conf.write_text(yaml.safe_dump(cfg))
    m = "rwkv7-tiny"
    base = ["--config-file", str(conf), "--model", m]
    src, vocab, ref = res / m / "source", res / m / "vocab" / "rwkv_vocab.tsv", res / m / "reference" / "stream.npz"

    def ok(rc):
        assert rc == 0, "building the tiny results tree failed (see the captured stderr)"

    ok(cli.toolchain(["--config-file", str(conf), "--out", str(res / "toolchain.json")]))
    ok(cli.source([*base, "--out", str(src)]))
    ok(cli.vocab([*base, "--source", str(src), "--out", str(vocab)]))
    ok(cli.reference([*base, "--source", str(src), "--vocab", str(vocab), "--out", str(ref)]))
    for r in cfg["models"][m]["recipes"]:
        exp, aot = res / m / "export" / r, res / m / "aot" / "universal" / r
        ok(cli.export([*base, "--recipe", r, "--source", str(src), "--out", str(exp)]))
        ok(cli.aot([*base, "--recipe", r, "--target", "universal", "--export", str(exp), "--out", str(aot)]))
        ok(cli.gate([*base, "--recipe", r, "--export", str(exp), "--aot", str(aot), "--reference", str(ref),
                     "--json", str(res / m / "gate" / f"{r}.json"), "--tsv", str(res / m / "gate" / f"{r}.tsv")]))
    ok(cli.card([*base, "--results", str(res), "--out", str(res / m / "card" / "README.md")]))
    for out in [src, *(res / m).glob("export/*"), *(res / m).glob("aot/*/*")]:
        (out / ".snakemake_timestamp").touch()  # what Snakemake leaves in every directory() output
    return res


@pytest.fixture(autouse=True, scope="module")
def _results_tree_for_modules_that_read_one(request):
    """A test module with a module-level ``RESULTS`` reads the tree built by ``tiny_results``."""
    if hasattr(request.module, "RESULTS"):
        request.module.RESULTS = request.getfixturevalue("tiny_results")
