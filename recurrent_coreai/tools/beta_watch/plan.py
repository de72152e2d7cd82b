"""The jobs a tree would run: today ``snakemake -n`` read back by regex (jobs.parse_jobs).

Kept alone on purpose: pipeline/dag.py is to grow ONE job-listing function for status,
beta-watch and the DVC generator; swapping it in here changes nothing else in beta-watch
(callers use ``plan(tree, env, *extra, python=...) -> list[Job]``)."""

from __future__ import annotations

import sys
from pathlib import Path

from recurrent_coreai.tools.beta_watch.jobs import Job, parse_jobs, snakemake
from recurrent_coreai.util.errors import PipelineError


def plan(tree: Path, env: dict, *extra: str, python: str = sys.executable) -> list[Job]:
    """The jobs ``snakemake -n publish`` would run in ``tree`` (``extra``: e.g. --forcerun toolchain),
    in the order Snakemake lists them."""
    rc, out = snakemake(tree, ["-n", "--nolock", *extra, "publish"], env, python)
    if rc:
        last = out.strip().splitlines()[-1:] or [f"exit {rc}"]
        raise PipelineError(tree / "Snakefile", f"snakemake -n failed: {last[0][:300]}", "fix the pipeline first")
    return list(parse_jobs(out)[0].values())
