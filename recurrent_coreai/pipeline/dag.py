"""dvc.yaml from the Snakemake DAG, and the check that the two never drift apart.

Snakemake is the source of truth: every job of ``publish`` (rule, wildcards, formatted shell
command, inputs, outputs) becomes one DVC stage with the same ``cmd``, ``deps`` and ``outs``.
DVC then adds what it is good at: ``params`` from config.yaml, gate JSONs as ``metrics``, the
per-step TSVs as ``plots``. Both sides are read through private APIs of the pinned versions
(snakemake 9.27.1, dvc 3.67.1).

:func:`snakemake_jobs` is THE job listing of the project: the DVC generator and its drift check,
``status`` (through the generated dvc.yaml, this listing serialised) and ``beta-watch`` (through
``python -m recurrent_coreai.pipeline.dag --json``, run by the Python and in the tree whose jobs
it wants) all read it. Why a private API: Snakemake 9.27.1's public ``snakemake.api`` builds a DAG
only to act on it (execute, dry-run, print dot/d3, summaries, reports); none returns the jobs as
data. Its text outputs are the alternative: ``-n`` prints a log meant for people (a regex over it
breaks with the wording), ``--summary`` lists output files without commands or wildcards, and
``--d3dag``/``--dag`` give labels, not inputs or commands. The one structured public channel, the
logger-plugin events (``JOB_INFO`` in a dry run), reaches only a handler installed as a
``snakemake-logger-plugin-*`` distribution. So this module reads ``Workflow.dag`` after
``_prepare_dag``/``_build_dag`` (what ``dag()`` does before acting), in this one place;
tests/test_dag_drift.py fails if the pinned Snakemake changes it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import posixpath
import re
import sys
from pathlib import Path

import yaml

from recurrent_coreai.pipeline.config import DEFAULT_FILE, stage_keys
from recurrent_coreai.pipeline import code_groups
from recurrent_coreai.util.errors import PipelineError

def snakemake_jobs(workdir: str | Path = ".", target: str = "publish", *, forceall: bool = True,
                   forcerun: tuple[str, ...] = ()) -> list[dict]:
    """The jobs Snakemake would run for ``target``, as plain data (``rule``, ``wildcards``, the
    formatted shell ``cmd`` or None, ``deps``, ``outs``). ``forceall``: every job, as from
    scratch (sorted by rule and wildcards); else only those the tree needs now, with the rules
    of ``forcerun`` forced (what ``snakemake -n --forcerun ...`` plans), in a DAG order (a job
    after every job it needs). Nothing is run and no lock is taken."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import (ConfigSettings, DAGSettings, OutputSettings, ResourceSettings,
                                          StorageSettings)

    workdir = Path(workdir).resolve()
    cwd = os.getcwd()
    jobs = []
    try:
        with contextlib.redirect_stderr(io.StringIO()), SnakemakeApi(OutputSettings(quiet={"all"})) as api:
            wf_api = api.workflow(snakefile=workdir / "Snakefile", workdir=workdir,
                                  resource_settings=ResourceSettings(cores=1),
                                  config_settings=ConfigSettings(), storage_settings=StorageSettings())
            wf_api.dag(DAGSettings(targets={target}, forceall=forceall, forcerun=frozenset(forcerun)))
            wf = wf_api._workflow  # noqa: SLF001 - private API of the pinned snakemake (see the module docstring)
            wf._prepare_dag(forceall=forceall, ignore_incomplete=forceall, lock_warn_only=True,  # noqa: SLF001
                            nolock=True)
            wf._build_dag()  # noqa: SLF001
            chosen = set(wf.dag.jobs) if forceall else set(wf.dag.needrun_jobs())
            for level in wf.dag.toposorted(chosen):
                for job in sorted(level, key=lambda j: (j.rule.name, sorted(j.wildcards_dict.items()))):
                    jobs.append({
                        "rule": job.rule.name, "wildcards": dict(job.wildcards_dict),
                        "cmd": job.shellcmd.strip() if job.shellcmd else None,
                        "deps": sorted(str(f) for f in job.input), "outs": sorted(str(f) for f in job.output),
                    })
    finally:
        os.chdir(cwd)
    by_name = (lambda j: (j["rule"], sorted(j["wildcards"].items())))
    return sorted(jobs, key=by_name) if forceall else jobs


def stage_name(job: dict) -> str:
    parts = [job["rule"]] + [job["wildcards"][k] for k in ("model", "target", "recipe", "shard") if k in job["wildcards"]]
    return re.sub(r"[^A-Za-z0-9_-]", "_", "-".join(parts))


def _present(cfg: dict, key: tuple[str, ...]) -> bool:
    for part in key:
        if not isinstance(cfg, dict) or part not in cfg:
            return False
        cfg = cfg[part]
    return True


def param_keys(rule: str, wildcards: dict, cfg: dict) -> list[str]:
    """config.yaml keys of a stage for DVC (from config.STAGE_KEYS, the stages' own table), those
    that ``cfg`` holds (DVC refuses a missing one; adding it regenerates dvc.yaml). DVC splits
    keys on '.', so a key through a name with a dot (rwkv7-goose-1.5b) stops there."""
    keys = set()
    for key in filter(lambda k: _present(cfg, k), stage_keys(rule, **wildcards)):
        cut = next((i for i, part in enumerate(key) if "." in part), len(key))
        keys.add(".".join(key[:cut]))
    return sorted(keys)


def code_group(job: dict, cfg: dict) -> str:
    """The job's code set (pipeline/code_groups.py)."""
    return code_groups.group(job["rule"], family_of(job, cfg), tokenizer_of(job, cfg))


def code_stage(jobs: list[dict], cfg: dict) -> dict:
    """dvc.yaml's ``code`` stage for ``jobs``: every code file they run in, one group file per code
    set out (pipeline/code_groups.py; Snakemake hashes the same code through ``params: code``)."""
    results = str(cfg.get("results", "results"))
    names = sorted({code_group(j, cfg) for j in jobs if j["cmd"] is not None})
    deps = sorted({f for name in names for f in code_groups.files(name)} | set(code_groups.own_files()))
    out = code_groups.path(results, "").rsplit("/", 1)[0]
    stage = {"cmd": f"python {code_groups.SCRIPT} --config-file {DEFAULT_FILE} --out {out} {' '.join(names)}",
             "deps": deps}
    if _present(cfg, ("results",)):  # where it writes; and DVC reads config.yaml before it runs anything
        stage["params"] = [{DEFAULT_FILE: ["results"]}]
    stage["outs"] = [code_groups.path(results, name) for name in names]
    return stage


def dvc_stages(jobs: list[dict], cfg: dict) -> dict:
    stages = {code_groups.STAGE: code_stage(jobs, cfg)}
    results = str(cfg.get("results", "results"))
    for job in jobs:
        if job["cmd"] is None:  # the aggregate `publish` rule runs nothing
            continue
        w = job["wildcards"]
        # the code it runs, as its code set's file (Snakemake sees the same through params: code)
        stage = {"cmd": " ".join(job["cmd"].split()),
                 "deps": [*job["deps"], code_groups.path(results, code_group(job, cfg))]}
        params = param_keys(job["rule"], w, cfg)
        if params:
            stage["params"] = [{DEFAULT_FILE: params}]
        outs = list(job["outs"])
        if job["rule"] == "gate":
            stage["metrics"] = [{o: {"cache": True}} for o in outs if o.endswith(".json")]
            stage["plots"] = [{o: {"x": "step", "y": "max_abs_dlogits", "template": "linear"}}
                              for o in outs if o.endswith(".tsv")]
            outs = []
        if outs:
            stage["outs"] = outs
        stages[stage_name(job)] = stage
    return {"stages": stages}


HEADER = ("# GENERATED from the Snakemake DAG by `python scripts/gen_dvc.py` -- do not edit by hand.\n"
          "# tests/test_dag_drift.py fails when this file and the Snakefile disagree.\n")


def render(jobs: list[dict], cfg: dict) -> str:
    """dvc.yaml for ``jobs``, with the params that ``cfg`` (config.yaml) holds."""
    return HEADER + yaml.safe_dump(dvc_stages(jobs, cfg), sort_keys=False, width=1000)


def dvc_index(workdir: str | Path = ".") -> dict[str, dict]:
    """What DVC itself parses from dvc.yaml: {stage: {cmd, deps, outs}} (outs incl. metrics/plots)."""
    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo

    with Repo(str(workdir)) as repo:
        out = {}
        for st in repo.index.stages:
            out[st.name] = {"cmd": st.cmd, "deps": sorted(d.def_path for d in st.deps if not isinstance(d, ParamsDependency)),
                            "outs": sorted(o.def_path for o in st.outs)}
        return out


def family_of(job: dict, cfg: dict) -> str | None:
    """The family of the job's model (None for a job without a model, e.g. toolchain)."""
    model = job["wildcards"].get("model")
    return cfg["models"][model]["family"] if model is not None else None


def tokenizer_of(job: dict, cfg: dict) -> str | None:
    """The tokenizer kind of the job's model (``families.tokenizer_of``; None without a model)."""
    from recurrent_coreai import families

    model = job["wildcards"].get("model")
    return families.tokenizer_of(cfg["models"][model]) if model is not None else None


def drift(jobs: list[dict], index: dict[str, dict], cfg: dict) -> list[str]:
    """Differences between Snakemake's jobs and DVC's stages (empty = in agreement); dvc.yaml's
    ``code`` stage, which no Snakemake job is, against :func:`code_stage` of the jobs."""
    problems = []
    want = {stage_name(j): j for j in jobs if j["cmd"] is not None}
    results = str(cfg.get("results", "results"))
    code = code_stage(jobs, cfg)
    if code_groups.STAGE not in index:
        problems.append(f"stage {code_groups.STAGE} (the code each stage runs) is not in dvc.yaml")
    else:
        st = index[code_groups.STAGE]
        for key in ("cmd", "deps", "outs"):
            ours, theirs = code[key], st[key]
            if (" ".join(ours.split()) != " ".join(str(theirs).split())) if key == "cmd" else sorted(ours) != sorted(theirs):
                problems.append(f"stage {code_groups.STAGE}: {key} differ from the code the Snakefile's jobs run")
    for name in sorted(set(want) - set(index)):
        problems.append(f"stage {name} is in the Snakefile but not in dvc.yaml")
    for name in sorted(set(index) - set(want) - {code_groups.STAGE}):
        problems.append(f"stage {name} is in dvc.yaml but not in the Snakefile")
    for name in sorted(set(want) & set(index)):
        job, st = want[name], index[name]
        if " ".join(job["cmd"].split()) != " ".join(str(st["cmd"]).split()):
            problems.append(f"stage {name}: cmd differs")
        deps = sorted(set(job["deps"] + [code_groups.path(results, code_group(job, cfg))]))
        if deps != sorted(st["deps"]):
            problems.append(f"stage {name}: deps {st['deps']} != inputs {deps}")
        if sorted(job["outs"]) != st["outs"]:
            problems.append(f"stage {name}: outs {st['outs']} != outputs {job['outs']}")
    return problems


# --- the committed dvc.yaml as a graph of stages (status reads it; no DVC, no Snakemake) ---
DVC_YAML_FIX = "regenerate it from the Snakefile: python scripts/gen_dvc.py (or restore it: git checkout -- dvc.yaml)"


def stage_rule(name: str) -> str:
    """The rule of a stage named by :func:`stage_name` (a rule name is a Python identifier: no '-')."""
    return name.split("-", 1)[0]


def load_yaml_file(path: Path, fix: str) -> object:
    """The YAML document in ``path`` (libyaml's loader where there is one, as DVC's files are big);
    text that is not UTF-8, or not YAML, is one line naming the file (and the line) with ``fix``.
    A missing file raises FileNotFoundError: whether that is an error is the caller's call."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise PipelineError(path, "is not UTF-8 text (binary?)", fix) from None
    try:
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise PipelineError(path, f"is not valid YAML{at} ({getattr(exc, 'problem', None) or 'unreadable'})",
                            fix) from None


def _kind(value) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", type(None): "empty",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _norm(path: str) -> str:
    return posixpath.normpath(path.replace(os.sep, "/"))


def _paths(where: Path, stage: str, key: str, entries) -> list[str]:
    """The paths of a deps/outs/metrics/plots list: each entry a path, or ``{path: {options}}``."""
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise PipelineError(where, f"stage {stage!r}: its {key} are {_kind(entries)}, not a list of paths",
                            DVC_YAML_FIX)
    out = []
    for entry in entries:
        if isinstance(entry, dict) and len(entry) == 1 and key != "deps":
            entry = next(iter(entry))
        if not isinstance(entry, str) or not entry:
            raise PipelineError(where, f"stage {stage!r}: an entry of its {key} is {_kind(entry)}, not a path",
                                DVC_YAML_FIX)
        out.append(_norm(entry))
    return out


def read_listing(path: str | Path = "dvc.yaml") -> "StageGraph":
    """The stages of a generated dvc.yaml (the job listing, serialised) as a :class:`StageGraph`:
    every stage's ``deps`` and ``outs`` (outs, metrics and plots; params left out), read with
    YAML alone -- ~10 ms for 55 stages, where :func:`dvc_index` (DVC's own parse) takes ~0.7 s.
    A missing file, or one that is not the mapping of stages gen_dvc.py writes, is a
    PipelineError naming the file and the fix."""
    path = Path(path)
    try:
        doc = load_yaml_file(path, DVC_YAML_FIX)
    except FileNotFoundError:
        raise PipelineError(path, "not found (the stages of the Snakemake DAG, as DVC reads them)",
                            DVC_YAML_FIX) from None
    if not isinstance(doc, dict):
        raise PipelineError(path, f"is not a DVC pipeline (its top level is {_kind(doc)}, not a mapping)",
                            DVC_YAML_FIX)
    stages = doc.get("stages")
    if not isinstance(stages, dict):
        raise PipelineError(path, f"is not a DVC pipeline (its stages are {_kind(stages)}, not a mapping)",
                            DVC_YAML_FIX)
    listing = {}
    for name, st in stages.items():
        if not isinstance(st, dict):
            raise PipelineError(path, f"stage {name!r} is {_kind(st)}, not a mapping", DVC_YAML_FIX)
        listing[str(name)] = {"deps": _paths(path, name, "deps", st.get("deps")),
                              "outs": [o for key in ("outs", "metrics", "plots")
                                       for o in _paths(path, name, key, st.get(key))]}
    return StageGraph(listing)


class StageGraph:
    """Stages and the files between them: a stage needs another when one of its deps is an out of
    the other, or lies inside it (a directory out), or holds it (a directory dep). Paths are as
    dvc.yaml writes them: relative to the repository root, '/'-separated."""

    def __init__(self, stages: dict[str, dict[str, list[str]]]):
        self.stages = stages
        self._writer: dict[str, str] = {}  # out -> its stage
        self._under: dict[str, set[str]] = {}  # directory -> the outs below it
        for name, st in stages.items():
            for out in st["outs"]:
                out = _norm(out)
                self._writer[out] = name
                for parent in self._parents(out):
                    self._under.setdefault(parent, set()).add(out)
        self._needs = {name: {self._writer[o] for dep in st["deps"] for o in self._outs_for(_norm(dep))} - {name}
                       for name, st in stages.items()}
        self._feeds: dict[str, set[str]] = {name: set() for name in stages}
        for name, needs in self._needs.items():
            for other in needs:
                self._feeds[other].add(name)

    @staticmethod
    def _parents(path: str) -> list[str]:
        parts = path.split("/")
        return ["/".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]

    def _outs_for(self, path: str) -> set[str]:
        """The outs a path is, lies in, or holds."""
        found = {p for p in [path, *self._parents(path)] if p in self._writer}
        return found | self._under.get(path, set())

    def writer(self, path: str | Path) -> tuple[str, str] | None:
        """(stage, out) of the stage whose out is ``path`` or a directory holding it; None if none."""
        path = _norm(str(path))
        for p in [path, *self._parents(path)]:
            if p in self._writer:
                return self._writer[p], p
        return None

    def writers_under(self, directory: str | Path) -> dict[str, str]:
        """{out: stage} of every out inside ``directory``."""
        return {out: self._writer[out] for out in self._under.get(_norm(str(directory)), ())}

    def needs(self, name: str) -> set[str]:
        """The stages whose outs ``name`` depends on directly."""
        return set(self._needs[name])

    def _closure(self, names, edges: dict[str, set[str]]) -> set[str]:
        seen, todo = set(), [n for n in names if n in edges]
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(edges[name] - seen)
        return seen

    def upstream(self, names) -> set[str]:
        """``names`` and every stage whose outputs they depend on, transitively."""
        return self._closure(names, self._needs)

    def downstream(self, names) -> set[str]:
        """``names`` and every stage that depends on their outputs, transitively."""
        return self._closure(names, self._feeds)

    def between(self, sources, sinks) -> set[str]:
        """The stages on a path from a stage of ``sources`` to one of ``sinks`` (both included)."""
        return self.downstream(sources) & self.upstream(sinks)


def main(argv: list[str] | None = None) -> int:
    """``python -m recurrent_coreai.pipeline.dag [--planned] [--forcerun RULE] [TARGET]``: the job
    list as JSON on stdout's last line, for a caller that needs it from another Python or tree
    (beta-watch asks the beta venv, in its worktree)."""
    ap = argparse.ArgumentParser(prog="python -m recurrent_coreai.pipeline.dag", description=main.__doc__)
    ap.add_argument("target", nargs="?", default="publish")
    ap.add_argument("--workdir", type=Path, default=Path("."), help="the tree holding the Snakefile (default: .)")
    ap.add_argument("--planned", action="store_true",
                    help="only the jobs the tree needs now (as snakemake -n plans), not every job")
    ap.add_argument("--forcerun", action="append", default=[], metavar="RULE", help="force this rule (repeatable)")
    ns = ap.parse_args(argv)
    jobs = snakemake_jobs(ns.workdir, ns.target, forceall=not ns.planned, forcerun=tuple(ns.forcerun))
    sys.stdout.write(json.dumps(jobs) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
