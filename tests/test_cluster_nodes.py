"""Several SLURM nodes on one host (tests/cluster/start.sh DIR NODES: one slurmd per node, Debian's
slurm-wlm is built with MULTIPLE_SLURMD): jobs that each want a whole node land on different
nodes. Run by `make test-cluster`, after tests/test_cluster.py's single-node cluster is stopped
(one slurmctld at a time on a host)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

CLUSTER = Path(__file__).resolve().parent / "cluster"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("RECURRENT_COREAI_TEST_CLUSTER") != "1",
                       reason="starts a SLURM here: `make test-cluster` runs it (RECURRENT_COREAI_TEST_CLUSTER=1)"),
    pytest.mark.skipif(shutil.which("slurmctld") is None,
                       reason="slurmctld not installed: `make test-cluster` installs SLURM and runs this test"),
    pytest.mark.skipif(os.geteuid() != 0, reason="starting slurmd/slurmctld here needs root"),
]


def host_offer() -> tuple[int, int]:
    """(CPUs, RealMemory MB) that slurmd finds on this host."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"CPUs=(\d+)", out).group(1)), int(re.search(r"RealMemory=(\d+)", out).group(1))


def test_two_nodes_on_one_host_each_take_a_whole_node_job(tmp_path):
    state = tmp_path / "slurm"
    cpus, mem = host_offer()
    # each node offered more CPUs than the host has (config_overrides) and half its memory, as the
    # 1.5B gate shards ran (docs/cluster.md): the jobs below ask exactly that, so only this offer fits them
    env = {**os.environ, "NODE_CPUS": str(cpus + 2), "NODE_MEM_MB": str(mem // 2)}
    start = subprocess.run(["timeout", "-k", "5", "120", "bash", str(CLUSTER / "start.sh"), str(state), "2"],
                           capture_output=True, text=True, env=env)
    try:
        assert start.returncode == 0, f"tests/cluster/start.sh failed:\n{start.stdout}\n{start.stderr}"
        assert "node(s) n[1-2]" in start.stdout, start.stdout
        nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T %c %m"], capture_output=True, text=True, check=True)
        assert sorted(nodes.stdout.splitlines()) == [f"n{i} idle {cpus + 2} {mem // 2}" for i in (1, 2)], nodes.stdout
        name = f"nodes-{uuid.uuid4().hex[:8]}"
        ids = [subprocess.run(["sbatch", "--parsable", "--exclusive", "-c", str(cpus + 2), "--mem", f"{mem // 2}M", "-J", name, "-o", "/dev/null", "--wrap", "sleep 3"],
                              capture_output=True, text=True, check=True).stdout.strip() for _ in range(2)]
        for job in ids:  # sbatch --wait would serialise them; poll until both ended
            subprocess.run(["timeout", "120", "sh", "-c", f"while squeue -h -j {job} | grep -q .; do sleep 0.5; done"],
                           check=True)
        out = subprocess.run(["sacct", "-X", "-P", "-n", "--name", name, "-S", "now-1hours", "-o", "JobID,State,NodeList"],
                             capture_output=True, text=True, check=True).stdout
        rows = [line.split("|") for line in out.splitlines() if line]
        assert sorted(r[0] for r in rows) == sorted(ids) and {r[1] for r in rows} == {"COMPLETED"}, out
        assert sorted(r[2] for r in rows) == ["n1", "n2"], f"both whole-node jobs ran on one node: {out}"
    finally:
        subprocess.run(["timeout", "-k", "5", "120", "bash", str(CLUSTER / "stop.sh"), str(state)])
    assert not list(state.glob("slurmd*.daemon.pid")), "stop.sh left a slurmd running"


@pytest.mark.parametrize("var, value", [("NODE_MEM_MB", "host+1"), ("NODE_CPUS", "0"), ("NODE_MEM_MB", "12G")])
def test_a_bad_node_offer_is_one_line_before_anything_starts(tmp_path, var, value):
    _, mem = host_offer()
    value = str(mem + 1) if value == "host+1" else value
    state = tmp_path / "slurm"
    proc = subprocess.run(["timeout", "-k", "5", "60", "bash", str(CLUSTER / "start.sh"), str(state), "2"],
                          capture_output=True, text=True, env={**os.environ, var: value})
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: tests/cluster/start.sh: {var} is '{value}' -- fix: "), proc.stderr
    assert not state.exists()  # nothing started, nothing to stop
