"""Every file a stage reads is an input its rule declares (so Snakemake and DVC rerun it when
that file changes). Each stage process of the session's Snakemake build (``smk_repo``) ran under
an audit hook that logged every file it opened (tests/audit/sitecustomize.py); here each is
matched against its DAG job's inputs and outputs, in the copy the build ran in."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from recurrent_coreai.pipeline import dag
from recurrent_coreai.pipeline.fingerprint import code_files

# fsutil.atomic_path writes <dir>/.<name>.<random>.tmp/<name>: that is <dir>/<name>, the output
TEMP = re.compile(r"/\.([^/]+)\.[A-Za-z0-9_]+\.tmp(?:/\1)?(?=/|$)")


def _declared(job: dict, tree: Path) -> list[Path]:
    """The job's inputs and outputs, and what else Snakemake and DVC track for it: its code (the
    ``code`` param; DVC deps) and the config file it is given (the ``settings`` param; DVC params)."""
    cmd = job["cmd"].split()
    config = cmd[cmd.index("--config-file") + 1]
    return [tree / p for p in [*job["deps"], *job["outs"], *code_files(job["rule"]), config]]


def test_every_file_a_stage_opens_is_a_declared_input_or_output(opened_files, repo_root):
    jobs = dag.snakemake_jobs(repo_root)
    by_name = {dag.stage_name(j): j for j in jobs}
    tracked = set(subprocess.run(["git", "ls-files"], cwd=repo_root, capture_output=True, text=True,
                                 check=True).stdout.splitlines())
    tree = opened_files.tree  # the copy the build ran in: the recorded paths point into it
    results, package = tree / "results", tree / "recurrent_coreai"
    by_label, others = opened_files.by_label(jobs)
    checked, undeclared = 0, []
    for label, opened in sorted(by_label.items()):
        declared = _declared(by_name[label], tree)
        for raw in sorted(opened):
            path = Path(TEMP.sub(r"/\1", raw))
            if (results / "logs") in path.parents:
                continue  # job logs are read (the report's export times) but never artifacts
            if results in path.parents:
                checked += 1
                if not any(path == d or d in path.parents for d in declared):
                    undeclared.append(f"{label}: {path.relative_to(results)}")
            elif (tree in path.parents and package not in path.parents
                  and str(path.relative_to(tree)) in tracked and path.parts[len(tree.parts)] != "tests"):
                if path not in declared:
                    undeclared.append(f"{label}: {path.relative_to(tree)} (a repository file)")
    assert set(by_label) == {n for n, j in by_name.items() if j["cmd"]}, "every stage ran under the audit"
    assert all(Path(argv[0]).name == "dvc_record.py" for argv in others), f"processes of no job: {others}"
    assert checked > 30, "the audit saw too few reads: is the hook recording?"
    assert undeclared == [], "files read but not declared as inputs:\n" + "\n".join(undeclared)
