"""Several SLURM nodes on one host (tests/cluster/start.sh DIR NODES: one slurmd per node, Debian's
slurm-wlm is built with MULTIPLE_SLURMD): jobs that each want a whole node land on different
nodes. Run by `make test-cluster`, after tests/test_cluster.py's single-node cluster is stopped
(one slurmctld at a time on a host)."""

from __future__ import annotations

import os
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


def test_two_nodes_on_one_host_each_take_a_whole_node_job(tmp_path):
    state = tmp_path / "slurm"
    start = subprocess.run(["timeout", "-k", "5", "120", "bash", str(CLUSTER / "start.sh"), str(state), "2"],
                           capture_output=True, text=True)
    try:
        assert start.returncode == 0, f"tests/cluster/start.sh failed:\n{start.stdout}\n{start.stderr}"
        assert "node(s) n[1-2]" in start.stdout, start.stdout
        nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, check=True)
        assert sorted(nodes.stdout.split()) == sorted(["n1", "idle", "n2", "idle"]), nodes.stdout
        name = f"nodes-{uuid.uuid4().hex[:8]}"
        ids = [subprocess.run(["sbatch", "--parsable", "--exclusive", "-J", name, "-o", "/dev/null", "--wrap", "sleep 3"],
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
