"""bench/bench_cluster_run.py reads a SLURM run back from sacct: against a fake sacct that prints
what SLURM 22.05 printed for a run of the DAG (allocation rows, then batch and srun steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_cluster_run as bcr  # noqa: E402

RUN = "aadf3abb-0000-4000-8000-000000000000"
ROWS = [  # JobID|State|ExitCode|NodeList|Submit|Start|End|ElapsedRaw|TotalCPU|ReqMem|ReqCPUS|MaxRSS|Comment
    "7|COMPLETED|0:0|n1|2026-12-03T10:00:00|2026-12-03T10:00:02|2026-12-03T10:08:22|500|08:10.500|12100M|1||"
    "rule_gate_shard_wildcards_m-1b_int8_0",
    "7.batch|COMPLETED|0:0|n1|2026-12-03T10:00:02|2026-12-03T10:00:02|2026-12-03T10:08:22|500|00:01.000||1|12000K|",
    "7.0|COMPLETED|0:0|n1|2026-12-03T10:00:03|2026-12-03T10:00:03|2026-12-03T10:08:22|499|08:09.500||1|8.5G|",
    "8|COMPLETED|0:0|n2|2026-12-03T10:00:00|2026-12-03T10:00:02|2026-12-03T10:05:02|300|04:50|12100M|1||"
    "rule_gate_shard_wildcards_m-1b_int8_1",
    "8.0|COMPLETED|0:0|n2|2026-12-03T10:00:03|2026-12-03T10:00:03|2026-12-03T10:05:02|299|04:49||1|8800M|",
    "9|COMPLETED|0:0|n2|2026-12-03T10:05:10|2026-12-03T10:05:11|2026-12-03T10:09:11|240|1-00:00:01|12100M|1||"
    "rule_gate_shard_wildcards_m-1b_int8_2",
    "10|COMPLETED|0:0|n1|2026-12-03T10:09:20|2026-12-03T10:09:21|2026-12-03T10:09:41|20|00:15.250|1000M|1||"
    "rule_gate_wildcards_m-1b_int8",
    "11|COMPLETED|0:0|n1|2026-12-03T10:09:50|2026-12-03T10:09:51|2026-12-03T10:10:01|10|00:09|1000M|1||"
    "rule_card_wildcards_m-1b_int8",
    "12|COMPLETED|0:0|n1|2026-12-03T10:09:50|2026-12-03T10:09:51|2026-12-03T10:10:01|10|00:09|1000M|1||rule_x",
]
LINES = "\n".join(ROWS)
FAKE = f"""
import sys
args = sys.argv[1:]
assert "-S" in args and "-E" in args, args
if args[args.index("--name") + 1] == {RUN!r}:
    print({LINES!r})
"""


def sacct_on_path(directory: Path, monkeypatch, script: str) -> None:
    """``script`` as the ``sacct`` this process and its children find first."""
    (directory / "sacct").write_text(script)
    (directory / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture
def fake_sacct(tmp_path, monkeypatch):
    sacct_on_path(tmp_path, monkeypatch, f"#!{sys.executable}\n{FAKE}")


def test_units():
    assert bcr.seconds("08:10.500") == 490.5
    assert bcr.seconds("1-00:00:01") == 86401
    assert bcr.seconds("02:03:04") == 7384
    assert bcr.megabytes("12000K") == 12.0 and bcr.megabytes("8.5G") == 8500.0 and bcr.megabytes("") == 0.0


def test_jobs_fold_their_steps_and_the_gate_is_summed_from_its_shards(fake_sacct):
    from datetime import datetime

    jobs = bcr.sacct_jobs(RUN, datetime(2026, 12, 3, 9))
    assert [j["id"] for j in jobs] == ["7", "8", "9", "10", "11", "12"]
    assert [j["peak_rss_mb"] for j in jobs[:3]] == [8500, 8800, 0]  # the largest step's; none sampled for 9
    assert jobs[0]["cpu_s"] == 490.5 and jobs[2]["cpu_s"] == 86401
    gates = bcr.summary(jobs, submit_s=2.0)
    assert list(gates) == ["m-1b_int8"]
    g = gates["m-1b_int8"]
    assert g["shards"] == 3 and g["nodes"] == ["n1", "n2"] and g["shard_wall_s"] == [500, 300, 240]
    assert g["wall_s"] == 579  # 10:00:02 (first shard's start) .. 10:09:41 (the gather's end)
    # LPT on the CPU seconds: one node runs all three (+2 s each), then the gather's 20 s
    assert g["modelled_wall_s"][1] == pytest.approx(490.5 + 290 + 86401 + 3 * 2 + 20)
    assert g["modelled_wall_s"][16] == pytest.approx(86401 + 2 + 20)


def test_the_command_prints_every_job_and_writes_json(fake_sacct, tmp_path):
    log = tmp_path / "run.log"
    log.write_text(f"Building DAG of jobs...\nSLURM run ID: {RUN}\n")
    out = subprocess.run([sys.executable, str(ROOT / "bench/bench_cluster_run.py"), "--log", str(log),
                          "--since", "2026-12-03T09:00:00", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, check=True).stdout
    assert "6 SLURM jobs" in out and "gate m-1b_int8: 3 shards on n1, n2" in out
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["gates"]["m-1b_int8"]["wall_s"] == 579 and got["span_s"] == 601  # 10:00:00 .. 10:10:01
    assert got["dag_modelled_wall_s"]["16"] == 601 - 579 + round(86401 + 2 + 20)


def test_a_log_without_a_run_id_is_one_line(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("Building DAG of jobs...\n")
    proc = subprocess.run([sys.executable, str(ROOT / "bench/bench_cluster_run.py"), "--log", str(log)],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0
    assert str(log) in proc.stderr and "-- fix:" in proc.stderr


def test_sacct_failing_is_one_line(tmp_path, monkeypatch):
    sacct_on_path(tmp_path, monkeypatch,
                  "#!/bin/sh\necho 'sacct: error: Problem talking to the database: Connection refused' >&2\nexit 1\n")
    log = tmp_path / "run.log"
    log.write_text(f"SLURM run ID: {RUN}\n")
    proc = subprocess.run([sys.executable, str(ROOT / "bench/bench_cluster_run.py"), "--log", str(log)],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: sacct: sacct: error: Problem talking to the database") and "-- fix:" in proc.stderr
