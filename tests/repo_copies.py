"""Repository copies and built trees shared by the tests (and, under pytest-xdist, by workers).

* :func:`fresh_copy`: what a fresh clone holds, committed in a new git repo, with the tests'
  short gate (:data:`SHORT_GATE`) or (``short=False``) config.yaml as committed -- the gate of the
  shared build and of every tree derived from it;
* :func:`run`: a shell command in such a copy, running that copy's package;
* :func:`shared_build`: build a tree once per test session, whichever worker needs it first;
  the others wait for it and reuse it (a file lock in the session's common temp directory);
* :func:`built` with ``record_opened``: the files each stage process opens during the build
  (tests/audit/sitecustomize.py), read back by :func:`opened_records`;
* :func:`snapshot_results`: the results tree right after a build (and Snakemake's metadata of
  its outputs), apart from the copy;
* trees derived from that snapshot instead of built again from nothing: :func:`one_model_tree`
  (the default model's outputs in a copy whose config builds that model only, recorded in DVC by
  ``scripts/dvc_record.py``: what the tests that change a built tree work on) and
  :func:`dvc_rebuilt_tree` (config.yaml as committed; one model's outputs removed; ``dvc repro``
  builds that model from nothing and nothing else).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import yaml
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
# A shorter gate for the trees a test builds on its own (the SLURM run's, a few fault tests): 2
# prompts, 40 steps (config.yaml ships 127), a 256-token text stream with two horizons (config.yaml:
# 2048, four). The shared build and its derived trees use config.yaml's.
SHORT_GATE = {"prompts": ["Hello, who are you?", "What is 17 times 23?"], "steps": 40,
              "text": {"file": "fixtures/text/heldout.txt", "tokens": 256, "horizons": [128, 256]}}
GIT_DATES = {"GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}


def env(**extra) -> dict:
    out = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
               DVC_NO_ANALYTICS="1", HF_HUB_OFFLINE="1", SOURCE_DATE_EPOCH="1767225600")
    out.update(extra)  # a caller may override any of these (the user's build: SOURCE_DATE_EPOCH="")
    out.pop("HF_TOKEN", None)
    return out


BUILD_TIMEOUT = 3000  # s: a hung build fails its tests instead of the whole CI run


def run(cmd, cwd, timeout=1200, check=True, **extra):
    """A shell command in a repository copy, running that copy's package (PYTHONPATH), not the
    editable install's."""
    extra = {"PYTHONPATH": str(cwd), **extra}  # a caller's PYTHONPATH should name the copy first too
    proc = subprocess.run(cmd, cwd=cwd, env=env(**extra), capture_output=True, text=True, timeout=timeout,
                          shell=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def short_gate(cfg: dict) -> dict:
    cfg["gate"].update(SHORT_GATE)
    return cfg


def fresh_copy(dest: Path, edit: Callable[[dict], None] | None = None, short: bool = True) -> Path:
    """What a fresh clone holds (tracked + new, not ignored files), with the short gate (and
    ``edit`` applied to its config.yaml), committed in a new git repo with fixed dates.
    ``short=False`` and no ``edit``: config.yaml as committed, byte for byte (the user's build)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    cfg_path = dest / "config.yaml"
    if short or edit:
        cfg = yaml.safe_load(cfg_path.read_text())
        if short:
            short_gate(cfg)
        if edit:
            edit(cfg)
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    run("git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm copy", dest, **GIT_DATES)
    return dest


def shared_build(tmp_path_factory, name: str, build: Callable[[Path], dict]) -> tuple[Path, dict]:
    """``build(dir)`` once per session across pytest-xdist workers; returns (dir, what build
    returned, JSON-able). A failed build is not retried: every test that needs it fails with
    the first failure's message."""
    base = tmp_path_factory.getbasetemp()
    common = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    # a developer iterating on a few test files may keep the shared builds of an earlier session
    # (docs/testing.md): the directory holding its shared-<name>.json and what it names
    common = Path(os.environ.get("RECURRENT_COREAI_TEST_SHARED") or common)
    where, done = common / f"shared-{name}", common / f"shared-{name}.json"
    with FileLock(str(common / f"shared-{name}.lock")):
        if not done.is_file():
            where.mkdir(parents=True)
            try:
                built = {"ok": build(where)}
            except BaseException as exc:
                done.write_text(json.dumps({"failed": f"{type(exc).__name__}: {exc}"}))
                raise
            done.write_text(json.dumps(built))
    record = json.loads(done.read_text())
    if "failed" in record:
        raise AssertionError(f"the shared {name} build failed earlier in this session: {record['failed'][-3000:]}")
    return where, record["ok"]


# --- the two full builds of the integration tests: `snakemake` and `dvc repro` in fresh copies ---
RECIPES = ("fp32", "fp16", "int8keepproj")  # the default model's


def tracked_outputs(repo: Path) -> dict[str, str]:
    """sha256 of every file below every DVC-tracked output (outs, metrics, plots)."""
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    digests = {}
    for st in stages.values():
        for key in ("outs", "metrics", "plots"):
            for out in st.get(key, []):
                path = repo / (next(iter(out)) if isinstance(out, dict) else out)
                files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
                for f in files:
                    if f.name != ".snakemake_timestamp":
                        digests[str(f.relative_to(repo))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return digests


def gate_numbers(repo: Path) -> dict:
    keys = ("steps", "agree_counted", "counted", "near_ties", "max_abs_dlogits", "mean_kl", "pass")
    return {r: {k: json.loads((repo / f"results/rwkv7-tiny/gate/{r}.json").read_text())[k] for k in keys}
            for r in RECIPES}


def built(repo: Path, cmd: str, seed: str, record_opened: Path | None = None, short: bool = True) -> dict:
    """Build a fresh copy with ``cmd``; what later tests compare, recorded right after the build.
    With ``record_opened`` (a directory), every stage process writes there what it opened;
    ``short=False``: with config.yaml as committed (the full gate), not the tests' short gate."""
    extra = {}
    if record_opened is not None:
        record_opened.mkdir(parents=True, exist_ok=True)
        extra = {"PYTHONPATH": f"{repo}{os.pathsep}{AUDIT}", OPENED_DIR_VAR: str(record_opened)}
    if not short:  # the user's build: no SOURCE_DATE_EPOCH (the card then states no date), as `make publish`
        extra["SOURCE_DATE_EPOCH"] = ""
    # the whole default DAG: ~10 min on a 2-core machine of its own, twice that beside the other worker
    proc = run(cmd, fresh_copy(repo, short=short), timeout=BUILD_TIMEOUT, PYTHONHASHSEED=seed, **extra)
    status = run("git status --porcelain --untracked-files=all", repo).stdout
    return {"output": proc.stdout + proc.stderr, "outputs": tracked_outputs(repo), "gates": gate_numbers(repo),
            "dvc_lock": (repo / "dvc.lock").read_text(), "git_status": status}


# --- what the stages of a build opened, and the results tree it left ---
AUDIT = Path(__file__).resolve().parent / "audit"  # its sitecustomize.py records a stage's opened files
OPENED_DIR_VAR = "RWKV7_TEST_OPENED_DIR"


def opened_records(where: Path, tree: Path) -> list[dict]:
    """The per-process records a build with ``record_opened=where`` left: ``{"argv", "opened"}``
    of every ``scripts/*.py`` process, sorted; only the opened paths inside ``tree`` (the copy
    built: its results, its repository files) are kept -- reads elsewhere (the interpreter, the
    site-packages) are nothing a rule could declare."""
    inside = os.path.join(os.path.realpath(tree), "")  # the job's cwd is the physical path
    records = []
    for f in sorted(where.glob("*.json")):
        rec = json.loads(f.read_text())
        records.append({"argv": rec["argv"], "opened": [p for p in rec["opened"] if p.startswith(inside)]})
    return sorted(records, key=lambda r: r["argv"])


def snapshot_results(repo: Path, dest: Path) -> Path:
    """``repo/results`` as it is now, copied (file times kept) to ``dest/results``, beside a
    ``dest/config.yaml`` that is the copy's own config with ``results`` pointing there (what a
    stage run by hand on the snapshot takes as --config-file), ``dest/metadata``, Snakemake's
    record of each output (.snakemake/metadata: params, code, inputs; what its rerun triggers
    compare) and ``dest/dvc-cache``, DVC's copies of them (.dvc/cache/files, hard links: those
    files are never changed, only added; not its run cache). Returns ``dest/results``."""
    shutil.copytree(repo / "results", dest / "results", symlinks=True, copy_function=shutil.copy2)
    shutil.copytree(repo / ".snakemake" / "metadata", dest / "metadata", copy_function=shutil.copy2)
    shutil.copytree(repo / ".dvc" / "cache" / "files", dest / "dvc-cache" / "files", copy_function=os.link)
    cfg = yaml.safe_load((repo / "config.yaml").read_text())
    cfg["results"] = str(dest / "results")
    (dest / "config.yaml").write_text(yaml.safe_dump(cfg))
    return dest / "results"


# --- trees derived from the snakemake build's snapshot ------------------------------------------------
MODEL = "rwkv7-trained"  # the model the tests that change a built tree work on: rwkv7, and a 256-id head (its gates ~7x cheaper than rwkv7-tiny's)
# The model `dvc repro` builds from nothing in dvc_rebuilt_tree (tests/conftest.py ``dvc_repo``): a
# cheap one (a 1024-token vocabulary: its exports and gates are the shortest) that shares no stage's
# outputs with another model -- DVC restores such a stage from its cache instead of running it
# (mamba2-tiny's vocab is mamba1-tiny's: the same GPT-NeoX tokenizer). Every other model's outputs
# there are the snakemake build's, compared with the committed dvc.lock's digests.
DVC_REBUILDS = "gdn-tiny"
RAN = re.compile(r"^Running stage '([^']+)':", re.M)


def _copy_outputs(snapshot: Path, repo: Path, models: list[str] | None = None) -> None:
    """The snapshot's results (``models`` only, with toolchain.json and their logs), file times kept."""
    src, dst = snapshot / "results", repo / "results"
    if models is None:
        shutil.copytree(src, dst, symlinks=True, copy_function=shutil.copy2)
        return
    dst.mkdir()
    shutil.copy2(src / "toolchain.json", dst / "toolchain.json")
    for model in models:
        shutil.copytree(src / model, dst / model, symlinks=True, copy_function=shutil.copy2)
        if (src / "logs" / model).is_dir():
            shutil.copytree(src / "logs" / model, dst / "logs" / model, copy_function=shutil.copy2)


def one_model_tree(snapshot: Path, repo: Path, model: str = MODEL) -> dict:
    """What a fresh clone whose config.yaml builds ``model`` only (``build: [model]``, the
    committed gate) holds after `snakemake --cores 1 publish` -- without building it again: its DAG's
    outputs are the snakemake build's (the same jobs with the same params; bytes and file times
    kept), and so is Snakemake's record of them (.snakemake/metadata: the params and code its
    rerun triggers compare); dvc.yaml is generated for that DAG (scripts/gen_dvc.py) and
    committed, and DVC records the outputs as `make publish` does (scripts/dvc_record.py, which
    checks every output against its stage's record first). Returns what the tests compare."""
    fresh_copy(repo, edit=lambda cfg: cfg.update(build=[model]), short=False)
    run("python scripts/gen_dvc.py && git rm -q --cached dvc.lock && rm dvc.lock && git add dvc.yaml "
        "&& git -c user.name=t -c user.email=t@t commit -qm 'one model'", repo, **GIT_DATES)
    _copy_outputs(snapshot, repo, [model])
    shutil.copytree(snapshot / "metadata", repo / ".snakemake" / "metadata", copy_function=shutil.copy2,
                    dirs_exist_ok=True)
    proc = run("python scripts/dvc_record.py --config-file config.yaml --since 0", repo)
    run("git add dvc.lock && git -c user.name=t -c user.email=t@t commit -qm 'dvc.lock'", repo, **GIT_DATES)
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    return {"output": proc.stdout + proc.stderr, "stages": sorted(stages), "outputs": tracked_outputs(repo)}


def of_model(stage: str, model: str) -> bool:
    """Is the DVC stage one of ``model``'s (source-<model>, export-<model>-fp16, ...)?"""
    return stage.endswith(f"-{model}") or f"-{model}-" in stage


def _copy_cache_but(cache: Path, dest: Path, model: str, lock: Path) -> None:
    """The build's DVC cache (hard links), less the objects only ``model``'s stages record in
    ``lock``. DVC reruns a stage whose outputs are not in its cache, so the others' must be there;
    and it restores a stage's missing outputs from its cache instead of running it when its lock
    entry is unchanged, so that model's must not be: a fresh clone has no cache."""
    def objects(md5: str) -> set[str]:  # an output's objects: a directory's listing and its files
        found = {md5}
        listing = cache / "files" / "md5" / md5[:2] / md5[2:]
        if md5.endswith(".dir") and listing.is_file():
            found |= {entry["md5"] for entry in json.loads(listing.read_text())}
        return found

    mine, others = set(), set()
    for name, stage in yaml.safe_load(lock.read_text())["stages"].items():
        for out in stage.get("outs", []):
            (mine if of_model(name, model) else others).update(objects(out["md5"]))
    only_mine = mine - others
    shared = sorted(name for name, stage in yaml.safe_load(lock.read_text())["stages"].items()
                    if of_model(name, model) and stage.get("outs")
                    and all(objects(out["md5"]) <= others for out in stage["outs"]))
    assert not shared, (f"{model}'s stages {shared} record the same outputs as another model's: DVC would restore "
                        f"them from its cache, not build them -- fix: set DVC_REBUILDS to a model that shares none")

    def skip(folder: str, names: list[str]) -> set[str]:
        return {n for n in names if Path(folder).name + n in only_mine}

    shutil.copytree(cache, dest, copy_function=os.link, ignore=skip)


def dvc_rebuilt_tree(snapshot: Path, repo: Path, rebuild: str) -> dict:
    """A fresh copy with config.yaml as committed (the full gate, what a user builds) holding the
    snakemake build's outputs but those of ``rebuild``, then `dvc repro` (the user's environment:
    no SOURCE_DATE_EPOCH; another PYTHONHASHSEED): it must build ``rebuild`` from nothing -- and,
    finding every other output (the snakemake build's, the same config and environment) to be what
    the committed dvc.lock records, nothing else. What the tests compare, recorded right after."""
    fresh_copy(repo, short=False)
    _copy_outputs(snapshot, repo)
    _copy_cache_but(snapshot / "dvc-cache", repo / ".dvc" / "cache", rebuild, repo / "dvc.lock")
    shutil.rmtree(repo / "results" / rebuild)
    shutil.rmtree(repo / "results" / "logs" / rebuild, ignore_errors=True)
    proc = run("dvc repro", repo, timeout=BUILD_TIMEOUT, PYTHONHASHSEED="22", SOURCE_DATE_EPOCH="")
    status = run("git status --porcelain --untracked-files=all", repo).stdout
    output = proc.stdout + proc.stderr
    return {"output": output, "ran": sorted(RAN.findall(output)), "outputs": tracked_outputs(repo),
            "dvc_lock": (repo / "dvc.lock").read_text(), "git_status": status, "rebuilt": rebuild}
