"""The toolchain contract (recurrent_coreai/coreai/contract.py) checked in the beta venv, with
the new versions, before the rebuild: each miss is one line saying what degrades."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from recurrent_coreai.util.errors import PipelineError

CHECK = "recurrent_coreai.coreai.contract"


def check_contract(python: str, tree: Path, env: dict) -> list[dict]:
    """The misses of the contract with the new versions (``python``: the beta venv's), printed one
    line each. A check that cannot run at all is an error: the rebuild would fail the same way."""
    from recurrent_coreai.coreai.contract import miss_lines

    proc = subprocess.run([python, "-m", CHECK, "--json"], cwd=tree, env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    try:
        got = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except json.JSONDecodeError:
        got = None
    if got is None:
        last = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()[-1]
        raise PipelineError(python, f"cannot check the toolchain contract with the new versions: {last[:300]}",
                            f"run `{python} -m {CHECK}` to see why")
    held = got["checked"] - len(got["misses"])
    print(f"beta-watch: toolchain contract with the new versions: {held}/{got['checked']} hold", flush=True)
    for line in miss_lines(got["misses"]):
        print(f"  {line}", flush=True)
    return got["misses"]
