"""Shared fixtures: the repo root, the validated config, a tiny synthetic source."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("RWKV7_PROGRESS", "0")  # progress lines on stderr would break the one-line-error checks


# The files that build whole trees, longest first: under pytest-xdist (--dist loadfile,
# --no-loadscope-reorder) each worker starts on one of them and the short files fill in after.
HEAVY_FIRST = ("test_pipeline_integration.py", "test_pipeline_dvc.py", "test_beta_watch.py", "test_cluster.py",
               "test_reproducible.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


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


@pytest.fixture
def hub():
    """The local Hugging Face Hub stand-in (tests/hubserver.py) on 127.0.0.1."""
    from hubserver import HubServer

    with HubServer() as server:
        yield server
        assert server.errors == [], "the Hub stand-in itself failed"


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


class OpenedFiles:
    """Files opened (``open`` audit events) while recording, per label — so a test can check
    that every file a stage reads is an input its rule declares. Audit hooks cannot be removed;
    this one is installed once and costs nothing while no label is being recorded."""

    def __init__(self):
        self.label: str | None = None
        self.by_label: dict[str, set[str]] = {}
        sys.addaudithook(self._hook)

    def _hook(self, event, args):
        if self.label is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            self.by_label.setdefault(self.label, set()).add(os.path.abspath(path))

    @classmethod
    def loaded(cls, by_label: dict[str, list[str]]) -> "OpenedFiles":
        """A record read back (no hook of its own)."""
        record = cls.__new__(cls)
        record.label, record.by_label = None, {k: set(v) for k, v in by_label.items()}
        return record

    @contextlib.contextmanager
    def recording(self, label: str):
        self.label = label
        try:
            yield
        finally:
            self.label = None


OPENED = OpenedFiles()


@pytest.fixture(scope="session")
def smk_repo(tmp_path_factory):
    """A fresh copy built by `snakemake --cores 1 publish` (tests/test_pipeline_integration.py
    changes and restores it): (repo, what repo_copies.built recorded right after the build)."""
    from repo_copies import built, shared_build

    return shared_build(tmp_path_factory, "smk", lambda repo: built(repo, "snakemake --cores 1 publish", "11"))


@pytest.fixture(scope="session")
def dvc_repo(tmp_path_factory):
    """A fresh copy built by `dvc repro` (tests/test_pipeline_dvc.py)."""
    from repo_copies import built, shared_build

    return shared_build(tmp_path_factory, "dvc", lambda repo: built(repo, "dvc repro", "22"))


@pytest.fixture(scope="session")
def opened_files(tiny_results):
    """What each stage opened while ``tiny_results`` was built (recorded by whichever worker
    built it): ``.by_label[label]`` is a set of absolute paths."""
    del tiny_results  # built (or found built) first: that fills _TINY
    return _TINY["opened"]


_TINY: dict = {}


@pytest.fixture(scope="session")
def tiny_results(tmp_path_factory, repo_root) -> Path:
    """A complete results tree for rwkv7-tiny (fp32, fp16, int8keepproj on `universal`), built by
    the stage entry points with the tests' short gate (repo_copies.SHORT_GATE) -- what the card
    and publish tests read. Everything is real: the bundles are exported, lowered and gated.
    Built once per session (shared by pytest-xdist workers); each stage's opened files are
    recorded for tests/test_declared_inputs.py."""
    from repo_copies import shared_build

    root, built = shared_build(tmp_path_factory, "tiny", lambda where: _build_tiny(where, repo_root))
    _TINY["opened"] = OpenedFiles.loaded(built["opened"])
    return root / "results"


def _build_tiny(root: Path, repo_root: Path) -> dict:
    import yaml

    from repo_copies import short_gate
    from rwkv7_coreai import cli
    from rwkv7_coreai.doctor import SOURCES, doctor_json
    from rwkv7_coreai.paths import Layout, as_args, stage_args
    from rwkv7_coreai.report import report_inputs, report_path

    res = root / "results"
    cfg = short_gate(yaml.safe_load((repo_root / "config.yaml").read_text()))
    cfg["results"] = str(res)
    conf = root / "config.yaml"
    conf.write_text(yaml.safe_dump(cfg))
    m = "rwkv7-tiny"
    lay, recipes = Layout(res, m), cfg["models"][m]["recipes"]
    base = ["--config-file", str(conf), "--model", m]
    src, vocab, ref = map(str, (lay.source, lay.vocab, lay.reference))

    def run(stage, label, argv):
        """A stage, its opened files recorded under ``label`` (its DVC stage name: dag.stage_name)."""
        with OPENED.recording(label):
            rc = getattr(cli, stage)(argv)
        assert rc == 0, f"building the tiny results tree failed at {label} (see the captured stderr)"

    run("toolchain", "toolchain", ["--config-file", str(conf), "--out", str(lay.toolchain)])
    run("source", f"source-{m}", [*base, "--out", src])
    run("vocab", f"vocab-{m}", [*base, "--source", src, "--out", vocab])
    run("reference", f"reference-{m}", [*base, "--source", src, "--vocab", vocab, "--out", ref])
    for r in recipes:
        exp, aot = str(lay.export(r)), str(lay.aot("universal", r))
        run("export", f"export-{m}-{r}", [*base, "--recipe", r, "--source", src, "--out", exp])
        run("aot", f"aot-{m}-universal-{r}", [*base, "--recipe", r, "--target", "universal", "--export", exp, "--out", aot])
        run("gate", f"gate-{m}-{r}", [*base, "--recipe", r, "--export", exp, "--aot", aot, "--reference", ref,
                                      "--json", str(lay.gate_json(r)), "--tsv", str(lay.gate_tsv(r))])
        run("doctor", f"doctor-{m}-{r}", [*base, "--recipe", r, "--sources", *[str(repo_root / s) for s in SOURCES],
                                          "--checkpoint", src, "--export", exp, "--out", str(doctor_json(lay, r))])
    run("card", f"card-{m}", [*base, *stage_args("card", res, m, recipes), "--out", str(lay.card)])
    run("report", f"report-{m}", [*base, *as_args(report_inputs(lay, recipes)), "--out", str(report_path(lay))])
    run("publish", f"stage_and_push-{m}", [*base, *stage_args("publish", res, m, recipes, cfg["models"][m]["targets"]),
                                           "--out", str(lay.publish)])
    for out in [lay.source, *(lay.export(r) for r in recipes), *(lay.aot("universal", r) for r in recipes)]:
        (out / ".snakemake_timestamp").touch()  # what Snakemake leaves in every directory() output
    return {"opened": {label: sorted(paths) for label, paths in OPENED.by_label.items()}}


@pytest.fixture(autouse=True, scope="module")
def _results_tree_for_modules_that_read_one(request):
    """A test module with a module-level ``RESULTS`` reads the tree built by ``tiny_results``."""
    if hasattr(request.module, "RESULTS"):
        request.module.RESULTS = request.getfixturevalue("tiny_results")
