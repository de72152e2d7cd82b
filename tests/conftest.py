"""Shared fixtures: the repo root, the validated config, a tiny synthetic source."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

import recurrent_coreai  # noqa: F401  -- before anything loads numpy, as in every stage process: it caps
# numpy's kernels (util/numpy_simd.py), so what a test computes here is what the stages compute

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("RECURRENT_COREAI_PROGRESS", "0")  # progress lines on stderr would break the one-line-error checks


# The order the files are handed to the pytest-xdist workers (--dist loadfile, --no-loadscope-reorder: a
# worker takes the next file when it has at most two tests left). Every built tree comes from ONE
# `snakemake --cores 1 publish` of the default DAG (``smk_repo``), so its file goes first, and the
# other worker meanwhile runs the files that need no built tree, longest first, instead of waiting;
# then the `dvc repro` file (its tree is derived from that build) and the files that read the build.
FIRST = "test_pipeline_integration.py"
NEEDS_A_BUILD_LAST = ("test_pipeline_dvc.py",)  # the rest of those keep their collected order after it
# measured (2026-12-02, this project's 2-core machine): the longest files that need no built tree
LONG = ("test_rwkv6_fp16_rescale_coreai.py", "test_rwkv6_export.py", "test_gate_breaks.py",
        "test_status_bad_records.py", "test_export.py", "test_config.py", "test_dag_listing.py",
        "test_faults_runtime.py", "test_config_strict.py", "test_bad_inputs.py", "test_rwkv6_official.py",
        "test_memory_discipline.py", "test_bad_inputs_integrity.py", "test_doctor_per_recipe.py")
BUILT = {"smk_repo", "tiny_results", "opened_files", "dvc_repo", "one_model_repo"}


def _needs_a_build(item) -> bool:
    return bool(BUILT & set(getattr(item, "fixturenames", ()))) or hasattr(item.module, "RESULTS")


def pytest_collection_modifyitems(items):
    """Files in this order: FIRST; the files none of whose tests needs a built tree (LONG first);
    NEEDS_A_BUILD_LAST; the other files that need one. Within a file the tests keep their order."""
    needs = {}
    for item in items:
        needs[item.path] = needs.get(item.path, False) or _needs_a_build(item)

    def rank(item):
        name = item.path.name
        if name == FIRST:
            return (0, 0)
        if not needs[item.path]:
            return (1, LONG.index(name) if name in LONG else len(LONG))
        return (2, 0) if name in NEEDS_A_BUILD_LAST else (3, 0)

    items.sort(key=rank)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def cfg():
    from recurrent_coreai.pipeline import config

    return config.load(ROOT / "config.yaml")


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory, cfg) -> Path:
    """results/<model>/source for the default tiny model, built once per session."""
    from recurrent_coreai.stages.source import build_source

    out = tmp_path_factory.mktemp("tiny") / "source"
    build_source("rwkv7-tiny", cfg["models"]["rwkv7-tiny"], cfg["vocab"], out)
    return out


@pytest.fixture(scope="session")
def world_vocab(cfg) -> dict[int, bytes]:
    from recurrent_coreai.tokenizers import world as vocab

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
    """What the stage processes of the session's Snakemake build (``smk_repo``) opened, recorded by
    an audit hook in each (tests/audit/sitecustomize.py): ``tree`` is the copy they ran in
    (resolved), ``processes`` one ``{"argv", "opened"}`` per ``scripts/*.py`` process, the opened
    paths absolute and inside ``tree``."""

    def __init__(self, tree: str | Path, processes: list[dict]):
        self.tree = Path(tree).resolve()
        self.processes = processes

    def by_label(self, jobs: list[dict]) -> tuple[dict[str, set[str]], list[list[str]]]:
        """The opened paths per DAG job (label: its DVC stage name, dag.stage_name) -- a process
        is the job whose shell command it runs, argument for argument -- and the argv of every
        process that is no job's (a helper such as scripts/dvc_record.py)."""
        from recurrent_coreai.pipeline import dag

        by_cmd = {tuple(shlex.split(j["cmd"])): j for j in jobs if j["cmd"]}
        labels: dict[str, set[str]] = {}
        others = []
        for proc in self.processes:
            job = by_cmd.get(("python", *proc["argv"]))
            if job is None:
                others.append(proc["argv"])
            else:
                labels.setdefault(dag.stage_name(job), set()).update(proc["opened"])
        return labels, others


@pytest.fixture(scope="session")
def smk_repo(tmp_path_factory):
    """A fresh copy built by `snakemake --cores 1 publish` -- the whole default DAG, every family,
    with config.yaml as committed (the full gate, the user's environment: what `make publish` builds)
    -- the session's one build of it: (repo, what repo_copies.built
    recorded right after the build). Nothing changes it but the tests that edit a file and put it
    back. The same build gives ``tiny_results`` (its results tree, copied right after the build),
    ``opened_files`` (what its stage processes opened), and the trees derived from that copy:
    ``one_model_repo`` and ``dvc_repo``."""
    from repo_copies import shared_build

    return shared_build(tmp_path_factory, "smk", _build_smk)


def _build_smk(repo: Path) -> dict:
    from repo_copies import built, opened_records, snapshot_results

    opened = repo.parent / f"{repo.name}-opened"
    record = built(repo, "snakemake --cores 1 publish", "11", record_opened=opened, short=False)
    # before any test changes the copy: what tiny_results, opened_files and the derived trees start from
    results = snapshot_results(repo, repo.parent / f"{repo.name}-results")
    record["tiny"] = {"results": str(results), "tree": str(repo.resolve()),
                      "opened": opened_records(opened, repo)}
    return record


def _snapshot(smk_repo) -> Path:
    """The directory holding the snakemake build's snapshot (repo_copies.snapshot_results)."""
    return Path(smk_repo[1]["tiny"]["results"]).parent


@pytest.fixture(scope="session")
def dvc_repo(tmp_path_factory, smk_repo):
    """A fresh copy with config.yaml as committed -- the full gate, what a user builds -- holding
    the snakemake build's outputs but repo_copies.DVC_REBUILDS's, after `dvc repro` (repo_copies.dvc_rebuilt_tree):
    it builds that model from nothing and finds every other output to be the committed one, so its dvc.lock
    must be the committed one (tests/test_pipeline_dvc.py)."""
    from repo_copies import DVC_REBUILDS, dvc_rebuilt_tree, shared_build

    snapshot = _snapshot(smk_repo)
    return shared_build(tmp_path_factory, "dvc", lambda repo: dvc_rebuilt_tree(snapshot, repo, DVC_REBUILDS))


@pytest.fixture(scope="session")
def one_model_repo(tmp_path_factory, smk_repo):
    """The default model's DAG alone (config.yaml: ``build: [rwkv7-tiny]``, the full gate), its
    outputs the snakemake build's, recorded in DVC (repo_copies.one_model_tree): the tree the tests
    that rebuild, push, pull or damage a built tree change (tests/test_pipeline_integration.py).
    Snakemake and DVC plan, check and record its 19 stages there rather than the whole DAG's 73."""
    from repo_copies import one_model_tree, shared_build

    snapshot = _snapshot(smk_repo)
    return shared_build(tmp_path_factory, "one-model", lambda repo: one_model_tree(snapshot, repo))


@pytest.fixture(scope="session")
def opened_files(smk_repo) -> OpenedFiles:
    """What each stage process of the ``smk_repo`` build opened (tests/test_declared_inputs.py)."""
    tiny = smk_repo[1]["tiny"]
    return OpenedFiles(tiny["tree"], tiny["opened"])


@pytest.fixture(scope="session")
def tiny_results(smk_repo) -> Path:
    """A complete results tree for rwkv7-tiny (fp32, fp16, int8keepproj on `universal`, card,
    report, publish), built by `snakemake --cores 1 publish` with config.yaml's gate
    -- the ``smk_repo`` build, copied (file times kept) right after it,
    so the tests that change that copy never change this. Everything is real: the bundles are
    exported, lowered and gated. Beside it, ``config.yaml`` is the build's config with
    ``results`` pointing at this tree. Treat it as read-only: copy what a test changes."""
    return Path(smk_repo[1]["tiny"]["results"])


@pytest.fixture(autouse=True, scope="module")
def _results_tree_for_modules_that_read_one(request):
    """A test module with a module-level ``RESULTS`` reads the tree built by ``tiny_results``."""
    if hasattr(request.module, "RESULTS"):
        request.module.RESULTS = request.getfixturevalue("tiny_results")
