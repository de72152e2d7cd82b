"""Wall time of the default DAG on a fresh copy: ``snakemake --cores 1 publish`` as a user runs it.

    python bench/bench_dag.py [--keep DIR] [--json out.json]

Copies what a fresh clone holds (git-tracked files and new, not ignored ones) into a temporary git
repository, runs the default DAG there with this checkout's venv, and prints the wall time of the
whole command, the time per rule (from Snakemake's job start and finish lines, 1 s resolution),
the time Snakemake spent after the last job (the DVC record in ``onsuccess``) and the peak RSS of
any one process. The issue's target (docs/measurements/2026-12-01-dag-time.md): at most 4 min
on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAMP = re.compile(r"^\[(\w{3} \w{3}\s+\d+ [\d:]+ \d{4})\]$")
RULE = re.compile(r"^(?:local)?rule (\w+):$")
JOBID = re.compile(r"^\s+jobid: (\d+)$")
DONE = re.compile(r"^Finished jobid: (\d+)")


def fresh_copy(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    subprocess.run([*git, "init", "-q"], cwd=dest, check=True)
    subprocess.run([*git, "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-qm", "bench copy"], cwd=dest, check=True)
    return dest


def per_rule(log: str) -> tuple[dict[str, float], float | None]:
    """Seconds per rule, and the time of the last job's finish line (epoch s)."""
    stamp, started, spent, last = None, {}, collections.defaultdict(float), None
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if m := STAMP.match(line):
            stamp = datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y")
        elif (m := RULE.match(line)) and stamp:
            job = next((j.group(1) for j in map(JOBID.match, lines[i + 1:i + 12]) if j), None)
            if job:
                started[job] = (m.group(1), stamp)
        elif (m := DONE.match(line)) and m.group(1) in started and stamp:
            rule, t0 = started.pop(m.group(1))
            spent[rule] += (stamp - t0).total_seconds()
            last = stamp.timestamp()
    return dict(spent), last


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="build in this (new) directory and keep it")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    ns = ap.parse_args(argv)
    where = ns.keep or Path(tempfile.mkdtemp(prefix="bench-dag-"))
    where.mkdir(parents=True, exist_ok=True)
    repo = fresh_copy(where)
    env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(repo),
               DVC_NO_ANALYTICS="1", HF_HUB_OFFLINE="1")
    t0 = time.time()
    proc = subprocess.run(["snakemake", "--cores", "1", "publish"], cwd=repo, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return proc.returncode
    rules, last = per_rule(proc.stderr + proc.stdout)
    after = (t0 + wall - last) if last else None  # the finish lines have 1 s resolution: about ±1 s
    rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    lock = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True).stdout
    out = {"wall_s": round(wall, 1), "jobs_s": sum(rules.values()), "after_last_job_s": after and round(after, 1),
           "rules_s": dict(sorted(rules.items(), key=lambda kv: -kv[1])), "peak_rss_mb": round(rss_mb),
           "cpus": os.cpu_count(), "git_status_after": lock.splitlines()}
    print(f"snakemake --cores 1 publish: {wall:.0f} s ({wall / 60:.1f} min) on {os.cpu_count()} CPUs; jobs "
          f"{out['jobs_s']:.0f} s, after the last job (DVC record) {out['after_last_job_s']} s; "
          f"peak RSS {out['peak_rss_mb']} MB")
    for rule, s in out["rules_s"].items():
        print(f"  {rule:16s}{s:6.0f} s")
    print(f"git status after the build: {lock.strip() or 'clean'}")
    if ns.json:
        ns.json.write_text(json.dumps(out, indent=2) + "\n")
    if not ns.keep:
        shutil.rmtree(where, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
