"""Does the SLURM cluster answer? Run before anything is submitted or deleted (a ``--forcerun``
deletes outputs before their jobs start): a machine whose SLURM is not configured gave ~40
lines of sacct/sbatch errors and had already deleted the card.

    python profiles/slurm/check_cluster.py [PARTITION]      # exit 0, or one line and exit 1

From Python (the Snakefile, when the executor is slurm): ``check(partition)`` raises
:class:`PipelineError`. It asks ``sinfo`` for the partition (a controller that does not answer
fails here within ``timeout`` seconds) and, when the plugin would poll with ``sacct``, checks
that accounting answers too (else: ``--slurm-status-command squeue``)."""

from __future__ import annotations

import shutil
import subprocess
import sys

from recurrent_coreai.util.errors import PipelineError

WHERE = "SLURM (--profile profiles/slurm)"
NOTHING = "nothing was submitted or deleted"


def _ask(cmd: list[str], timeout: float) -> str:
    if shutil.which(cmd[0]) is None:
        raise PipelineError(WHERE, f"{cmd[0]} not found: this machine is not a SLURM submit host",
                            f"run on a submit host, or drop --profile profiles/slurm to build here; {NOTHING}")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PipelineError(WHERE, f"the cluster did not answer `{' '.join(cmd)}` within {timeout:g} s",
                            f"check that slurmctld runs and this host's slurm.conf names it; {NOTHING}") from None
    if proc.returncode != 0:
        said = next((ln.strip() for ln in proc.stderr.splitlines() if ln.strip()), f"exit {proc.returncode}")
        raise PipelineError(WHERE, f"the cluster does not answer `{' '.join(cmd)}` ({said[:200]})",
                            f"check that slurmctld runs and this host's slurm.conf names it; {NOTHING}")
    return proc.stdout


def check(partition: str | None = None, status_command: str = "sacct", timeout: float = 15.0) -> None:
    """One line (PipelineError) unless the controller answers, lists ``partition`` and, for
    ``status_command`` sacct, accounting answers."""
    out = _ask(["sinfo", "-h", "-o", "%P"] + (["-p", partition] if partition else []), timeout)
    names = [ln.strip().rstrip("*") for ln in out.splitlines() if ln.strip()]
    if partition and partition not in names:
        listed = _ask(["sinfo", "-h", "-o", "%P"], timeout).split()
        raise PipelineError(WHERE, f"partition {partition!r} does not exist (the cluster has "
                            f"{', '.join(p.rstrip('*') for p in listed) or 'none'})",
                            f"set slurm_partition in profiles/slurm/config.yaml or --default-resources; {NOTHING}")
    if status_command == "sacct":
        _ask(["sacct", "-n", "-X", "-S", "now", "-o", "JobID"], timeout)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        check(argv[0] if argv else None)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
