"""pipeline/dag.py is the one job listing: what it plans is what ``snakemake -n`` plans, and the
JSON it prints for another tree/venv (beta-watch) is the same list."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from recurrent_coreai.pipeline import dag
from recurrent_coreai.tools.beta_watch.jobs import Job, parse_jobs, snakemake
from recurrent_coreai.tools.beta_watch.plan import plan


def as_jobs(listing: list[dict]) -> list[Job]:
    return [Job(j["rule"], tuple(j["wildcards"].items())) for j in listing]


@pytest.mark.parametrize("extra", [(), ("--forcerun", "toolchain")], ids=["as-is", "forcerun-toolchain"])
def test_the_planned_jobs_are_what_snakemake_dry_run_plans(repo_root, extra):
    rc, out = snakemake(repo_root, ["-n", "--nolock", *extra, "publish"], dict(os.environ))
    assert rc == 0, out[-2000:]
    dry_run = list(parse_jobs(out)[0].values())
    listed = dag.snakemake_jobs(repo_root, forceall=False, forcerun=tuple(extra[1:]))
    assert sorted(as_jobs(listed)) == sorted(dry_run)
    # a DAG order: every job comes after the jobs whose outputs it reads
    made_at = {out: i for i, job in enumerate(listed) for out in job["outs"]}
    assert all(made_at.get(dep, -1) < i for i, job in enumerate(listed) for dep in job["deps"])
    assert plan(repo_root, dict(os.environ), *extra) == as_jobs(listed)  # beta-watch, through the JSON


def test_forcing_the_toolchain_plans_it_and_the_stages_after_it(repo_root):
    every = dag.snakemake_jobs(repo_root)
    forced = dag.snakemake_jobs(repo_root, forceall=False, forcerun=("toolchain",))
    assert {j["rule"] for j in forced} >= {"toolchain", "export", "aot", "gate", "card", "publish"}
    assert len(forced) <= len(every)
    assert {(j["rule"], tuple(j["wildcards"].items())) for j in forced} <= \
        {(j["rule"], tuple(j["wildcards"].items())) for j in every}


def test_the_json_listing_is_the_listing(repo_root):
    proc = subprocess.run([sys.executable, "-m", "recurrent_coreai.pipeline.dag", "--workdir", str(repo_root)],
                          capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == dag.snakemake_jobs(repo_root)
