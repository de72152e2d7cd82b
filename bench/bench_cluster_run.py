#!/usr/bin/env python3
"""What a Snakemake run through ``profiles/slurm`` cost, job by job, read back from SLURM's
accounting: node, queue wait, wall, CPU and peak RSS of every job, the gate's wall from its first
shard's start to its gather's end, and the gate's wall on 1, 2, 4, 8 and 16 nodes modelled from the
shards' measured CPU seconds (bench_gate_shards.lpt: longest first, one shard per node at a time),
and for a run of one gate, the run's wall with that modelled gate in place of the measured one.

    python bench/bench_cluster_run.py --log RUN.log [--since 2026-12-03T09:50:00] [--json PATH]

``--log``: the output of ``snakemake --profile profiles/slurm …`` (it names the run ID, the job
name every SLURM job of the run carries). ``--since``: where sacct's window opens (default: 24 h
ago; without one sacct starts it at 00:00 today and loses the jobs of a run that crossed midnight).
Needs ``sacct`` with slurmdbd (``tests/cluster/start.sh`` starts one). A job's CPU is SLURM's
TotalCPU (user + system of all its steps); its peak RSS is the largest MaxRSS of its steps, which
jobacct_gather samples (every 30 s by default), so it can miss a short peak: each stage's log has its
own ``peak RSS``.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_gate_shards import NODES, lpt  # noqa: E402

FIELDS = ("JobID", "State", "ExitCode", "NodeList", "Submit", "Start", "End", "ElapsedRaw", "TotalCPU",
          "ReqMem", "ReqCPUS", "MaxRSS", "Comment%300")
GATHER_RULE = "rule_gate_wildcards_"
SHARD_RULE = "rule_gate_shard_wildcards_"


def seconds(cpu: str) -> float:
    """SLURM's [D-]HH:MM:SS[.mmm] or MM:SS.mmm as seconds."""
    days, _, rest = cpu.rpartition("-")
    parts = [float(p) for p in rest.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0.0)
    return int(days or 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


def megabytes(rss: str) -> float:
    """sacct's MaxRSS (``123456K``, ``1.5G``, empty) as MB."""
    if not rss:
        return 0.0
    scale = {"K": 1e-3, "M": 1.0, "G": 1e3, "T": 1e6}
    return float(rss[:-1]) * scale[rss[-1]] if rss[-1] in scale else float(rss) / 1e6


def sacct_jobs(run_id: str, since: datetime) -> list[dict]:
    """One row per job of the run (allocation), its steps' peak RSS folded in."""
    try:
        out = subprocess.run(["sacct", "-P", "-n", "--name", run_id, "-S", f"{since:%Y-%m-%dT%H:%M:%S}", "-E", "now",
                              "-o", ",".join(FIELDS)], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        said = (getattr(exc, "stderr", None) or str(exc)).strip().splitlines()
        sys.exit(f"error: sacct: {said[0] if said else exc} -- fix: run it where SLURM's accounting (slurmdbd) of "
                 "that run is up (tests/cluster/start.sh starts one)")
    jobs: dict[str, dict] = {}
    for line in out.splitlines():
        row = dict(zip((f.split("%")[0] for f in FIELDS), line.split("|", len(FIELDS) - 1)))
        job, _, step = row["JobID"].partition(".")
        if not step:
            jobs[job] = {"id": job, "job": row["Comment"], "state": row["State"], "exit": row["ExitCode"],
                         "node": row["NodeList"], "submit": row["Submit"], "start": row["Start"], "end": row["End"],
                         "wall_s": int(row["ElapsedRaw"] or 0), "cpu_s": round(seconds(row["TotalCPU"]), 1),
                         "req_mem": row["ReqMem"], "req_cpus": int(row["ReqCPUS"] or 0), "peak_rss_mb": 0.0}
        elif job in jobs:
            jobs[job]["peak_rss_mb"] = max(jobs[job]["peak_rss_mb"], round(megabytes(row["MaxRSS"])))
    return sorted(jobs.values(), key=lambda j: (j["start"], j["id"]))


def when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)


def summary(jobs: list[dict], submit_s: float) -> dict:
    """Per gate: its shards (node, wall, CPU, RSS), its wall from the first shard's start to the
    gather's end, and the modelled wall on NODES from the shards' CPU seconds (then the gather's wall)."""
    gates = {}
    for gather in (j for j in jobs if j["job"].startswith(GATHER_RULE)):
        key = gather["job"][len(GATHER_RULE):]  # model_recipe (the plugin joins the wildcards with _)
        parts = [j for j in jobs if j["job"].startswith(SHARD_RULE) and j["job"][len(SHARD_RULE):].rpartition("_")[0] == key]
        if not parts:
            continue
        first = min(when(j["start"]) for j in parts)
        cpus = [j["cpu_s"] for j in parts]
        gates[key] = {"shards": len(parts), "nodes": sorted({j["node"] for j in parts}),
                      "shard_cpu_s": cpus, "shard_wall_s": [j["wall_s"] for j in parts],
                      "wall_s": round((when(gather["end"]) - first).total_seconds()),
                      "modelled_wall_s": {n: round(lpt(cpus, n, submit_s) + gather["wall_s"], 1) for n in NODES}}
    return gates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", type=Path, required=True, help="what snakemake --profile profiles/slurm printed")
    ap.add_argument("--since", type=datetime.fromisoformat, default=datetime.now() - timedelta(days=1))
    ap.add_argument("--submit-s", type=float, default=2.0, help="scheduling overhead per shard job in the model, s")
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    m = re.search(r"SLURM run ID: (\S+)", ns.log.read_text(errors="replace"))
    if not m:
        sys.exit(f"error: {ns.log}: no 'SLURM run ID' line -- fix: give the output of snakemake --profile profiles/slurm")
    jobs = sacct_jobs(m.group(1), ns.since)
    if not jobs:
        sys.exit(f"error: sacct has no job named {m.group(1)} since {ns.since:%F %T} -- fix: pass --since before the run")
    t0 = min(when(j["submit"]) for j in jobs)
    print(f"{len(jobs)} SLURM jobs of run {m.group(1)}")
    print(f"{'job':<58} {'node':<5} {'state':<10} {'start':>6} {'wait':>5} {'wall':>6} {'cpu':>7} {'rss MB':>7} asked")
    for j in jobs:
        wait = (when(j["start"]) - when(j["submit"])).total_seconds()
        print(f"{j['job'][:58]:<58} {j['node']:<5} {j['state']:<10} {(when(j['start']) - t0).total_seconds():6.0f} "
              f"{wait:5.0f} {j['wall_s']:6d} {j['cpu_s']:7.1f} {j['peak_rss_mb']:7.0f} {j['req_mem']} {j['req_cpus']} cpu")
    span = (max(when(j["end"]) for j in jobs) - t0).total_seconds()
    gates = summary(jobs, ns.submit_s)
    for key, g in gates.items():
        print(f"gate {key}: {g['shards']} shards on {', '.join(g['nodes'])}; wall {g['wall_s']} s from the first shard's "
              f"start to the gather's end; shard CPU {g['shard_cpu_s']} s")
        print("  modelled from the shards' CPU: " + ", ".join(f"{n} node(s) {w / 60:.1f} min"
                                                            for n, w in g["modelled_wall_s"].items()))
    print(f"first submit to last end: {span:.0f} s")
    dag = {}
    if len(gates) == 1:  # a one-gate DAG: the rest ran as it would on more nodes (its widest point
        # before the gate is the two branches reference and export, which 2 nodes already run side by side)
        g = next(iter(gates.values()))
        dag = {n: round(span - g["wall_s"] + w) for n, w in g["modelled_wall_s"].items()}
        print("  the whole run with that gate: " + ", ".join(f"{n} node(s) {w / 60:.1f} min" for n, w in dag.items()))
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps({"run_id": m.group(1), "jobs": jobs, "span_s": span, "gates": gates,
                                       "dag_modelled_wall_s": dag, "submit_s": ns.submit_s}, indent=2) + "\n")


if __name__ == "__main__":
    main()
