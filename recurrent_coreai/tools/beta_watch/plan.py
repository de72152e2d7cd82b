"""The jobs a tree would run, from the project's one job listing (pipeline/dag.py).

beta-watch needs the jobs Snakemake WOULD run in another tree with another venv (the worktree
with the bumped pins), so it runs the listing there, with that venv's Python:
``python -m recurrent_coreai.pipeline.dag --planned ...`` prints them as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from recurrent_coreai.tools.beta_watch.jobs import Job
from recurrent_coreai.util.errors import PipelineError

LISTING = "recurrent_coreai.pipeline.dag"


def plan(tree: Path, env: dict, *extra: str, python: str = sys.executable) -> list[Job]:
    """The jobs ``snakemake -n publish`` would run in ``tree`` (``extra``: e.g. ``--forcerun
    toolchain``), in a DAG order (a job after the jobs it needs)."""
    cmd = [python, "-m", LISTING, "--workdir", str(tree), "--planned", *extra, "publish"]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise PipelineError(tree / "Snakefile", f"cannot list the jobs it would run: {last[0][:300]}",
                            "fix the pipeline first (snakemake -n publish shows the problem)")
    return [Job(job["rule"], tuple(job["wildcards"].items())) for job in json.loads(lines[-1])]
