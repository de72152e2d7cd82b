"""Every file a stage reads is an input its rule declares (so Snakemake and DVC rerun it when
that file changes). The stages of the session's tiny results tree ran under an audit hook that
logged each opened file (tests/conftest.py); here each is matched against the DAG job's inputs
and outputs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from rwkv7_coreai import dag

# fsutil.atomic_path writes <dir>/.<name>.<random>.tmp/<name>: that is <dir>/<name>, the output
TEMP = re.compile(r"/\.([^/]+)\.[A-Za-z0-9_]+\.tmp(?:/\1)?(?=/|$)")


def _declared(job: dict, results: Path, repo: Path) -> list[Path]:
    """The job's inputs and outputs, with the DAG's ``results/`` mapped onto the tree under test."""
    paths = [Path(p) for p in job["deps"] + job["outs"]]
    return [results / p.relative_to("results") if p.parts[0] == "results" else repo / p for p in paths]


def test_every_file_a_stage_opens_is_a_declared_input_or_output(tiny_results, opened_files, repo_root):
    jobs = {dag.stage_name(j): j for j in dag.snakemake_jobs(repo_root)}
    tracked = set(subprocess.run(["git", "ls-files"], cwd=repo_root, capture_output=True, text=True,
                                 check=True).stdout.splitlines())
    results = tiny_results.resolve()
    package = repo_root / "rwkv7_coreai"
    checked, undeclared = 0, []
    for label, opened in sorted(opened_files.by_label.items()):
        declared = _declared(jobs[label], results, repo_root)
        for raw in sorted(opened):
            path = Path(TEMP.sub(r"/\1", raw))
            if (results / "logs") in path.parents:
                continue  # job logs are read (the report's export times) but never artifacts
            if results in path.parents:
                checked += 1
                if not any(path == d or d in path.parents for d in declared):
                    undeclared.append(f"{label}: {path.relative_to(results)}")
            elif (repo_root in path.parents and package not in path.parents
                  and str(path.relative_to(repo_root)) in tracked and path.parts[len(repo_root.parts)] != "tests"):
                undeclared.append(f"{label}: {path.relative_to(repo_root)} (a repository file)")
    assert set(opened_files.by_label) == {n for n, j in jobs.items() if j["cmd"]}, "every stage ran under the audit"
    assert checked > 30, "the audit saw too few reads: is the hook recording?"
    assert undeclared == [], "files read but not declared as inputs:\n" + "\n".join(undeclared)
