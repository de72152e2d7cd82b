"""Record in DVC the stages a Snakemake run executed — and only those.

``dvc commit -f`` of every stage would bless whatever sits in the workspace, including an
output altered after it was built. So we commit only the stages whose outputs this run wrote
(every output newer than the run's start; Snakemake stamps directory outputs on completion),
and only when the run used config.yaml's settings, which are what dvc.yaml and dvc.lock
describe. Anything else is left for ``dvc status`` to show as changed. And a stage is recorded
only when every output's bytes are the ones its stage recorded (``records.verify_output``: the
integrity chain); one that differs is one line, left unrecorded, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

from recurrent_coreai.pipeline import code_groups
from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.pipeline.paths import STATE_DIR
from recurrent_coreai.pipeline.records import verify_output
from recurrent_coreai.util.fsutil import file_state, remembered_digests

TIMESTAMP = ".snakemake_timestamp"


def built_since(path: Path, since: float) -> bool:
    """Was ``path`` (a file, or a directory output with Snakemake's stamp) written after ``since``?"""
    stamps = [path, path / TIMESTAMP] if path.is_dir() else [path]
    times = [p.stat().st_mtime for p in stamps if p.exists()]
    return bool(times) and max(times) >= since


def stage_outs(stage: dict) -> list[Path]:
    return [Path(next(iter(o)) if isinstance(o, dict) else o) for key in ("outs", "metrics", "plots")
            for o in stage.get(key, [])]


def executed_stages(stages: dict, since: float) -> list[str]:
    return [name for name, st in stages.items()
            if stage_outs(st) and all(built_since(p, since) for p in stage_outs(st))]


def unverified(stages: dict, names: list[str], derived: Callable[[dict], None] | None = None) -> dict[str, PipelineError]:
    """The first output of each stage in ``names`` whose bytes differ from its stage's record; then
    (``derived``, given by scripts/dvc_record.py: stages.derivation.check_stage, a layer above this
    one) the stage's derived records against the inputs its command names."""
    bad = {}
    for name in names:
        try:
            for out in stage_outs(stages[name]):
                verify_output(out)
            if derived is not None:
                derived(stages[name])
        except PipelineError as exc:
            bad[name] = exc
    return bad


def write_code_groups(stages: dict) -> bool:
    """The ``code`` stage's group files (pipeline/code_groups.py) as the checkout's code makes them,
    written where one is missing or differs (Snakemake does not make them: its rules hash the same
    code); whether they were written."""
    st = stages.get(code_groups.STAGE)
    if st is None:
        return False
    outs = [Path(o) for o in st.get("outs", [])]
    if not outs:
        return False
    return code_groups.write(outs[0].parent, [o.name.removesuffix(code_groups.SUFFIX) for o in outs])


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def _git_ok() -> str | None:
    try:
        proc = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return "git is not installed"
    return None if proc.returncode == 0 else "this tree is not a git repository (DVC needs one)"


@contextlib.contextmanager
def params_parsed_once():
    """DVC parses a stage's params file once for every param dependency it hashes or saves, with
    ruamel's pure-Python constructor: this project's config.yaml (27 KB) was parsed 494 times,
    ~40 ms each, to record the default DAG's 128 stages. Here each file is parsed once per path
    while its bytes are unchanged (fsutil.file_state) and every caller gets its own copy (DVC then reads the values from
    it as before: the same records). Skipped, untouched, where DVC no longer has the function."""

    from dvc.dependency import param

    load = getattr(param, "load_path", None)
    if load is None:
        yield
        return
    parsed: dict[tuple, object] = {}

    def load_once(fs_path, fs, **kwargs):
        try:
            st = os.stat(fs_path)
        except (OSError, TypeError, ValueError):
            return load(fs_path, fs, **kwargs)
        key = (os.path.abspath(fs_path), file_state(st), tuple(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = load(fs_path, fs, **kwargs)
        return copy.deepcopy(parsed[key])

    param.load_path = load_once
    try:
        yield
    finally:
        param.load_path = load


def dvc_commit(names: list[str], every: bool = False) -> str | None:
    """``dvc commit -f`` of ``names`` under a lock, so two runs in one tree never lose a record;
    None, or DVC's error in one line. ``every``: the names are all of dvc.yaml's stages, committed
    as the file (DVC reads dvc.yaml and dvc.lock once per target: 55 stage names took 70-110 s on
    2 cores, the file 9 s, the same dvc.lock).

    Through DVC's API with ``relink=False``: the outputs go into the cache and stay in the
    workspace as they are. The CLI relinks them, and with this repo's ``copy`` cache a file with a
    second link (publish hard-links the bundles and gate records into its tree) is then written
    again from the cache: its bytes unchanged, its time newer than the stages that read it (a gate
    JSON newer than its card: an mtime-driven `snakemake` plans them again), and every bundle
    copied once more (docs/dvc.md)."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    lock = Path(STATE_DIR) / "dvc-commit.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            with params_parsed_once(), Repo() as repo:
                if every:
                    repo.commit("dvc.yaml", force=True, relink=False)
                else:
                    commit_stages(repo, names)
        except DvcException as exc:
            return " ".join(str(exc).split()) or type(exc).__name__
    return None


def commit_stages(repo, names: list[str]) -> None:
    """What ``Repo.commit(name, force=True, relink=False)`` does for each of ``names``
    (dvc/repo/commit.py: save each stage, commit its outputs to the cache), with each dvc.lock
    written once for them all: ``Repo.commit`` rewrites dvc.lock once per call, and DVC's YAML
    round trip of this project's dvc.lock (~880 KB: every stage lists its code files) takes ~6 s
    (3.6 s parse, 2.3 s dump; docs/measurements/2026-12-06-dvc-lock.md) -- ten stages of a
    rebuild spent a minute on it."""
    from dvc.repo import lock_repo

    with lock_repo(repo):
        files: dict[str, tuple] = {}
        for name in names:
            for info in repo.stage.collect_granular(name):
                stage = info.stage
                stage.save()
                stage.commit(filter_info=info.filter_info, relink=False)
                files.setdefault(stage.dvcfile.path, (stage.dvcfile, []))[1].append(stage)
        for dvcfile, stages in files.values():
            dvcfile.dump_stages(stages, update_pipeline=False)


def main(argv: list[str] | None = None, derived: Callable[[dict], None] | None = None) -> int:
    """``derived``: see :func:`unverified`."""
    from recurrent_coreai.pipeline.dag import DVC_YAML_FIX, load_yaml_file, render, snakemake_jobs

    ap = argparse.ArgumentParser(prog="scripts/dvc_record.py")
    ap.add_argument("--config-file", default=cfgmod.DEFAULT_FILE)
    ap.add_argument("--since", type=float, default=0.0, help="record stages whose outputs are newer (epoch s)")
    ns = ap.parse_args(argv)
    if not Path(".dvc").is_dir():
        _say("DVC: not recorded: no .dvc directory here (running without DVC)")
        return 0
    reason = _git_ok()
    if reason:
        _say(f"DVC: not recorded: {reason}; the outputs were built without DVC -- fix: run from a git clone to track them")
        return 0
    try:
        differs = cfgmod.differs_from_default(cfgmod.load(ns.config_file))
    except PipelineError as exc:
        _say(f"error: {exc}")
        return 1
    if differs:
        _say(f"DVC: not recorded: this run's config differs from config.yaml at {', '.join(differs[:3])}"
             f"{' …' if len(differs) > 3 else ''}; dvc.lock describes config.yaml only -- fix: put the settings "
             "in config.yaml and run again to track these outputs")
        return 0
    text = render(snakemake_jobs("."), cfgmod.read_yaml(cfgmod.DEFAULT_FILE))
    if Path("dvc.yaml").read_text() != text:
        Path("dvc.yaml").write_text(text)
        _say("dvc.yaml regenerated from the Snakefile's DAG (commit it)")
    stages = load_yaml_file(Path("dvc.yaml"), DVC_YAML_FIX)["stages"]  # libyaml, as everything else reads it
    wrote_code = write_code_groups(stages)
    names = executed_stages({n: st for n, st in stages.items() if n != code_groups.STAGE}, ns.since)
    if code_groups.STAGE in stages and (names or wrote_code):  # the code the recorded stages ran, recorded beside
        names.insert(0, code_groups.STAGE)
    with remembered_digests():  # each output hashed once for every stage that checks it
        refused = unverified(stages, names, derived)
    for name, exc in refused.items():
        _say(f"error: {exc} (DVC: stage {name} not recorded)")
    names = [n for n in names if n not in refused]
    if names:
        why = dvc_commit(names, every=sorted(names) == sorted(stages))
        if why:
            _say(f"error: dvc commit: {why} -- fix: run `dvc status`, then `dvc commit -f {' '.join(names[:2])} …` by hand")
            return 1
    print(f"DVC: recorded the {len(names)} stage(s) this run built, of {len(stages)}")
    return 1 if refused else 0
