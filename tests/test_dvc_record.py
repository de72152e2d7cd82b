"""DVC's record of a build (pipeline/dvc_record.py ``dvc_commit``) leaves the workspace as it is.

publish hard-links the bundles and the gate records into its tree; with the repository's ``copy``
cache, `dvc commit` on the command line writes such a file again from the cache (same bytes, a new
inode and time): a gate JSON then is newer than the card that read it, and a Snakemake run that
goes by file times plans the card, report and publish again. The record goes through DVC's API
without the relink: every file keeps its inode and time, the cache holds it, and `dvc status` is
clean.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from recurrent_coreai.pipeline import dvc_record

DVC_YAML = """\
stages:
  gate:
    cmd: echo gate
    metrics:
    - gate.json:
        cache: true
    plots:
    - gate.tsv
  card:
    cmd: echo card
    deps:
    - gate.json
    outs:
    - card.md
  publish:
    cmd: echo publish
    deps:
    - card.md
    outs:
    - publish
"""
OLD = 1_700_000_000  # a build's file times, far from now


def sh(cmd: str, cwd: Path) -> str:
    env = dict(os.environ, DVC_NO_ANALYTICS="1")
    proc = subprocess.run(cmd, cwd=cwd, shell=True, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout}{proc.stderr}"
    return proc.stdout


@pytest.fixture
def built(tmp_path, monkeypatch) -> Path:
    """A git + DVC repo (``copy`` cache, as .dvc/config ships) after a build: gate, card, and a
    publish tree hard-linking the gate JSON and the card, each file older than the one after it."""
    repo = tmp_path / "repo"
    repo.mkdir()
    sh("git init -q && dvc init -q && dvc config cache.type copy", repo)
    (repo / "dvc.yaml").write_text(DVC_YAML)
    (repo / "gate.json").write_text('{"pass": true}\n')
    (repo / "gate.tsv").write_text("step\tmax_abs_dlogits\n0\t0.1\n")
    (repo / "card.md").write_text("# card\n")
    (repo / "publish").mkdir()
    os.link(repo / "gate.json", repo / "publish" / "gate.json")
    os.link(repo / "card.md", repo / "publish" / "README.md")
    for i, rel in enumerate(("gate.json", "gate.tsv", "card.md", "publish")):
        os.utime(repo / rel, (OLD + i, OLD + i))
    monkeypatch.chdir(repo)
    return repo


def files(repo: Path) -> dict[str, tuple[int, int, int]]:
    """(inode, links, mtime ns) of every file the stages wrote."""
    return {str(p.relative_to(repo)): (p.stat().st_ino, p.stat().st_nlink, p.stat().st_mtime_ns)
            for p in [repo / "gate.json", repo / "gate.tsv", repo / "card.md", *sorted((repo / "publish").iterdir())]}


@pytest.mark.parametrize("every", [True, False], ids=["dvc.yaml", "by stage"])
def test_the_record_keeps_every_file_its_inode_and_time(built, every):
    before = files(built)
    assert before["gate.json"][1] == 2  # the publish tree's link
    assert dvc_record.dvc_commit(["gate", "card", "publish"], every=every) is None
    assert files(built) == before
    assert (built / "dvc.lock").is_file()
    assert "up to date" in sh("dvc status", built)
    cached = {p.read_text() for p in (built / ".dvc" / "cache").rglob("*") if p.is_file() and p.stat().st_size < 100}
    assert '{"pass": true}\n' in cached and "# card\n" in cached


def test_the_command_line_commit_would_rewrite_the_linked_files(built):
    """Why the API: `dvc commit -f` relinks the hard-linked gate JSON (a new inode and time)."""
    before = files(built)
    sh("dvc commit -f -q dvc.yaml", built)
    after = files(built)
    assert after["gate.json"] != before["gate.json"] and after["gate.json"][2] > before["card.md"][2]


def test_a_dvc_failure_is_one_line(built):
    (built / "card.md").unlink()
    why = dvc_record.dvc_commit(["card"])
    assert why and "\n" not in why and "card.md" in why, why


def test_the_stages_of_a_record_are_written_to_dvc_lock_once_as_dvc_commit_writes_them(built, tmp_path, monkeypatch):
    """Every named stage is committed (outputs cached, dvc.lock entries) in one write of dvc.lock --
    the same dvc.lock, byte for byte, that `Repo.commit` per stage name writes with one write each."""
    import shutil

    from dvc.dvcfile import Lockfile
    from dvc.repo import Repo

    names = ["gate", "card", "publish"]
    other = tmp_path / "other"
    shutil.copytree(built, other, symlinks=True)
    monkeypatch.chdir(other)
    with Repo() as repo:
        for name in names:
            repo.commit(name, force=True, relink=False)
    monkeypatch.chdir(built)
    writes = []
    real = Lockfile.dump_stages
    monkeypatch.setattr(Lockfile, "dump_stages", lambda self, stages, **kw: (writes.append([s.name for s in stages]),
                                                                              real(self, stages, **kw))[1])
    assert dvc_record.dvc_commit(names) is None
    assert writes == [names]
    assert (built / "dvc.lock").read_text() == (other / "dvc.lock").read_text()
    assert "up to date" in sh("dvc status", built)


PARAMS_YAML = """\
stages:
  one:
    cmd: echo one
    params:
    - config.yaml:
      - gate.steps
    outs:
    - one.txt
  two:
    cmd: echo two
    params:
    - config.yaml:
      - gate.steps
      - models
    outs:
    - two.txt
"""


def test_the_params_file_is_parsed_once_per_record_and_recorded_as_dvc_records_it(tmp_path, monkeypatch):
    """DVC parses config.yaml for every param dependency (494 parses, ~40 ms each, for the default
    DAG): the record parses it once (dvc_record.params_parsed_once) and dvc.lock holds the same
    params; afterwards DVC's loader is its own again."""
    from dvc.dependency import param

    locks = {}
    for shim in (True, False):
        repo = tmp_path / f"repo-{shim}"
        repo.mkdir()
        sh("git init -q && dvc init -q && dvc config cache.type copy", repo)
        (repo / "dvc.yaml").write_text(PARAMS_YAML)
        (repo / "config.yaml").write_text("gate: {steps: 40, prompts: [a]}\nmodels: {m: {family: rwkv7}}\n")
        for name in ("one.txt", "two.txt"):
            (repo / name).write_text(name)
        monkeypatch.chdir(repo)
        parses = []
        real = param.load_path

        def counted(path, fs, **kwargs):
            parses.append(path)
            return real(path, fs, **kwargs)
        monkeypatch.setattr(param, "load_path", counted)
        if shim:
            assert dvc_record.dvc_commit(["one", "two"]) is None
            assert param.load_path is counted  # put back
            assert len(parses) == 1, parses
        else:
            from dvc.repo import Repo
            with Repo() as r:
                dvc_record.commit_stages(r, ["one", "two"])
            assert len(parses) > 1  # what the shim saves
        monkeypatch.undo()
        locks[shim] = (repo / "dvc.lock").read_text()
    assert locks[True] == locks[False]
    assert "gate.steps: 40" in locks[True]
