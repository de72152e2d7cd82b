"""The SLURM profile's pre-flight (profiles/slurm/check_cluster.py): on a machine whose SLURM
does not answer it is one line before anything is submitted or deleted. Fake sinfo/sacct in PATH."""

from __future__ import annotations

import importlib.util
import os
import stat
from pathlib import Path

import pytest

from recurrent_coreai.util.errors import PipelineError

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_cluster", ROOT / "profiles" / "slurm" / "check_cluster.py")
check_cluster = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_cluster)


def fake(bindir: Path, name: str, body: str) -> None:
    exe = bindir / name
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def bindir(tmp_path, monkeypatch):
    d = tmp_path / "bin"
    d.mkdir()
    monkeypatch.setenv("PATH", f"{d}{os.pathsep}/usr/bin{os.pathsep}/bin")
    for name in ("sinfo", "sacct"):  # only the fakes: never a real SLURM of this machine
        fake(d, name, "exit 0")
    return d


def test_a_cluster_that_does_not_answer_is_one_line(bindir):
    fake(bindir, "sinfo", 'echo "sinfo: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host" >&2\n'
                          'echo "sinfo: error: fetch_config: DNS SRV lookup failed" >&2; exit 1')
    with pytest.raises(PipelineError) as err:
        check_cluster.check("main")
    assert str(err.value) == ("SLURM (--profile profiles/slurm): the cluster does not answer `sinfo -h -o %P -p main` "
                              "(sinfo: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host) -- fix: check "
                              "that slurmctld runs and this host's slurm.conf names it; nothing was submitted or deleted")


def test_no_slurm_commands_and_a_hanging_controller(bindir, tmp_path, monkeypatch):
    (bindir / "sinfo").unlink()
    with monkeypatch.context() as m:  # only the fakes' folder: a real sinfo in /usr/bin (CI has one) stays unseen
        m.setenv("PATH", str(bindir))
        with pytest.raises(PipelineError, match="sinfo not found: this machine is not a SLURM submit host"):
            check_cluster.check("main")
    fake(bindir, "sinfo", "sleep 5")
    with pytest.raises(PipelineError, match=r"did not answer `sinfo -h -o %P -p main` within 0.5 s"):
        check_cluster.check("main", timeout=0.5)


def test_a_missing_partition_and_accounting_that_does_not_answer(bindir, capsys):
    fake(bindir, "sinfo", 'case "$*" in *"-p main"*) exit 0;; *) echo "debug*"; echo "gpu";; esac')
    with pytest.raises(PipelineError, match=r"partition 'main' does not exist \(the cluster has debug, gpu\)"):
        check_cluster.check("main")
    fake(bindir, "sinfo", 'echo "main*"')
    fake(bindir, "sacct", 'echo "sacct: error: Slurmctld has been configured without accounting" >&2; exit 1')
    with pytest.raises(PipelineError, match="does not answer `sacct"):
        check_cluster.check("main")
    check_cluster.check("main", status_command="squeue")  # squeue polling needs no accounting
    assert check_cluster.main(["main"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: SLURM (--profile profiles/slurm): ")


def test_snakemake_with_the_slurm_profile_stops_before_submitting_or_deleting(tmp_path, tiny_results):
    """The real entry point: `snakemake --profile profiles/slurm --forcerun card publish` on a built
    tree where SLURM does not answer: one error line, exit 1, the card (a --forcerun output) still
    there, sbatch never called (the Snakefile's onstart runs the check before any job starts)."""
    import shutil
    import subprocess
    import sys

    from repo_copies import fresh_copy

    repo = fresh_copy(tmp_path / "repo", short=False)  # the gate of tiny_results
    shutil.copytree(tiny_results, repo / "results")
    bins = tmp_path / "bin"
    bins.mkdir()
    for name in ("sinfo", "sacct", "squeue"):
        fake(bins, name, 'echo "$0: error: Could not establish a configuration source" >&2; exit 1')
    fake(bins, "sbatch", f'echo called >> {tmp_path}/sbatch.calls; exit 1')
    card = repo / "results" / "rwkv7-tiny" / "card" / "README.md"
    before = card.read_bytes()
    env = {**os.environ, "PATH": f"{bins}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}/usr/bin{os.pathsep}/bin",
           "PYTHONPATH": str(repo)}
    proc = subprocess.run(["snakemake", "--profile", "profiles/slurm", "--forcerun", "card", "publish"], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=300)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    errors = [ln for ln in out if ln.startswith("error:")]
    assert proc.returncode == 1
    assert errors == [out[-1]] and "SLURM (--profile profiles/slurm): the cluster does not answer" in out[-1]
    assert "nothing was submitted or deleted" in out[-1]
    assert card.read_bytes() == before and not (tmp_path / "sbatch.calls").exists()
