"""The rebuild in the worktree: seed it, bump the pins, prepare the beta venv, run Snakemake,
and check that it ran exactly the jobs a toolchain change plans."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from recurrent_coreai.tools.beta_watch.contract import check_contract
from recurrent_coreai.tools.beta_watch.jobs import Job, parse_jobs, snakemake
from recurrent_coreai.tools.beta_watch.pins import Updates, bump_pins
from recurrent_coreai.tools.beta_watch.plan import plan
from recurrent_coreai.tools.beta_watch.venv import prepare_env
from recurrent_coreai.tools.beta_watch.worktree import seed
from recurrent_coreai.util.errors import PipelineError


@dataclass
class Rebuild:
    """What a rebuild in the worktree did."""
    tree: Path
    planned: list[Job]
    executed: list[Job]
    failed: list[Job]
    exit: int
    seconds: float
    contract: list[dict] = field(default_factory=list)  # the toolchain contract's misses in the new venv


def rebuild(repo: Path, tree: Path, venv: Path, results: str, bw: dict, updates: Updates, expected: list[Job],
            log: Path) -> Rebuild:
    """Seed the worktree, bump the pins, prepare the venv, run Snakemake; check the job list."""
    seed(repo, tree, results)
    bump_pins(tree, updates)
    env = prepare_env(venv, tree, updates, bw["index_url"])
    python = str(venv / "bin" / "python")
    contract = check_contract(python, tree, env)  # before the rebuild: each miss is one line saying what degrades
    planned = plan(tree, env, python=python)
    if sorted(planned) != sorted(expected):
        differ = sorted(set(planned) ^ set(expected))
        raise PipelineError(tree, f"the bumped tree plans {len(planned)} jobs, a toolchain change {len(expected)} "
                            f"(differ: {', '.join(map(str, differ[:4]))})", "check that results/ was built from "
                            "HEAD (rebuild the baseline) and that only the pins differ")
    print(f"beta-watch: rebuilding {len(planned)} jobs in {tree} (log: {log})", flush=True)
    t0 = time.perf_counter()
    rc, out = snakemake(tree, ["--keep-going", "publish"], env, python, log=log)
    seconds = time.perf_counter() - t0
    announced, finished = parse_jobs(out)
    executed = [job for i, job in announced.items() if i in finished]  # in the order they started
    failed = [job for i, job in announced.items() if i not in finished]
    if rc == 0 and sorted(executed) != sorted(planned):
        differ = sorted(set(executed) ^ set(planned))
        raise PipelineError(log, f"the rebuild ran other jobs than planned ({', '.join(map(str, differ[:4]))})",
                            "inspect the snakemake log")
    return Rebuild(tree, planned, executed, failed, rc, seconds, contract)
