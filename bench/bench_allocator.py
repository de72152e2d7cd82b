"""A gate shard with and without util/allocator.py's keep_freed_memory, on a built tree.

    python bench/bench_allocator.py TREE MODEL [--recipes fp32 fp16 ...] [--json out.json]

TREE is a built copy of this repository (``bench/bench_dag.py --keep DIR``): each recipe's gate
shard runs there as the DAG runs it (``scripts/gate_shard.py`` with the arguments of its dvc.yaml
stage, output to a temporary file), once as it is and once with ``keep_freed_memory`` replaced by
a no-op, in fresh processes. Per run: wall, user and system seconds of the process, its peak RSS,
and whether the two shard JSONs are byte-identical (they must be: the allocator changes no number).
docs/measurements/2026-12-06-allocator.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

# the stage's own entry point, with keep_freed_memory a no-op (the runtime's default allocator)
WITHOUT = ("import runpy, sys; import recurrent_coreai.coreai.runtime as r; r.keep_freed_memory = lambda: False; "
           "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def shard_command(tree: Path, model: str, recipe: str) -> list[str]:
    stages = yaml.load((tree / "dvc.yaml").read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))["stages"]
    return shlex.split(stages[f"gate_shard-{model}-{recipe}-0"]["cmd"])


def run(cmd: list[str], tree: Path) -> dict:
    """One process: its own rusage (os.wait4), not the children's running maximum."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        if proc.returncode:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd[:4])}… failed:\n{err.read().decode(errors='replace')[-2000:]}")
    return {"wall_s": round(wall, 1), "user_s": round(usage.ru_utime, 1), "sys_s": round(usage.ru_stime, 1),
            "peak_rss_mb": round(usage.ru_maxrss / 1024)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tree", type=Path)
    ap.add_argument("model")
    ap.add_argument("--recipes", nargs="+", default=["fp32", "fp16"])
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in ns.recipes:
            cmd = shard_command(ns.tree, ns.model, recipe)
            out_at = cmd.index("--out") + 1
            runs = {}
            for mode in ("without", "with"):
                out = Path(tmp) / f"{recipe}-{mode}.json"
                cmd[out_at] = str(out)
                full = [sys.executable, *(["-c", WITHOUT] if mode == "without" else []), *cmd[1:]]
                runs[mode] = run(full, ns.tree)
            same = (Path(tmp) / f"{recipe}-without.json").read_bytes() == (Path(tmp) / f"{recipe}-with.json").read_bytes()
            rows.append({"model": ns.model, "recipe": recipe, **{f"{m} {k}": v for m, r in runs.items() for k, v in r.items()},
                         "identical": same})
            print(f"{ns.model} {recipe}: without {runs['without']}  with {runs['with']}  identical JSON: {same}")
    if ns.json:
        ns.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
