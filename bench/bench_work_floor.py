#!/usr/bin/env python3
"""The default DAG's work with every per-process cost taken away: a lower bound on its wall time.

    python bench/bench_work_floor.py TREE [--rules export,reference,gate_shard] [--json out.json]

``TREE`` is a built copy of the repository (``python bench/bench_dag.py --keep TREE``). For each
rule named, every one of that rule's stages in ``TREE/dvc.yaml`` runs again, in THIS process, one
after the other: its ``main`` (the module ``scripts/<stage>.py`` calls) with the stage's own
arguments, but ``--out`` and ``--log`` in a scratch directory, so the tree is left as it is.
The first stage of each rule runs once more before the timed ones and is reported apart: it pays
what a fresh process pays at its first call (``torch.export``'s lazy imports, the converter's and
the runtime's first-call set-up). What is left -- the timed calls -- is the stage's own work:
no interpreter start, no imports, no first call, no scheduling. Each timed call's wall and
process CPU seconds are reported, per rule summed, beside the same rule's seconds in the DAG
(Snakemake's per-rule sums: ``--dag-json``, the JSON ``bench_dag.py`` wrote for ``TREE``).

A bundle's bytes do not depend on what ran before it in the process (checked: the sha256 of
every ``main.mlirb`` and ``.odix`` an export or aot stage writes here is compared with the tree's
and the stages that differ are printed; exit 1 if any), so the floor measures the DAG's work. Run it on an idle machine: it is one core's work.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import json
import os
import resource
import shlex
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RULES = ("export", "reference", "gate_shard")


def stage_calls(tree: Path, rule: str) -> list[tuple[str, object, list[str]]]:
    """(stage name, its ``main``, its arguments) for every ``rule`` stage of ``tree``'s dvc.yaml."""
    from recurrent_coreai.pipeline import fingerprint  # the tree's (on the path first): rule -> script, module

    stages = yaml.safe_load((tree / "dvc.yaml").read_text())["stages"]
    calls = []
    for name, st in stages.items():
        if name.split("-")[0] != rule:
            continue
        argv = shlex.split(st["cmd"])
        if len(argv) < 2 or argv[0] != "python" or argv[1] != f"scripts/{fingerprint.ENTRY[rule][0]}.py":
            raise SystemExit(f"{tree / 'dvc.yaml'}: stage {name}: not a `python scripts/<stage>.py` command")
        calls.append((name, importlib.import_module(f"recurrent_coreai.{fingerprint.ENTRY[rule][1]}").main, argv[2:]))
    if not calls:
        raise SystemExit(f"{tree / 'dvc.yaml'}: no {rule} stage")
    return calls


def redirected(argv: list[str], scratch: Path, name: str) -> list[str]:
    """``argv`` with ``--out`` and ``--log`` under ``scratch`` (the output keeps its file name)."""
    out = list(argv)
    for flag in ("--out", "--log"):
        if flag in out:
            i = out.index(flag) + 1
            out[i] = str(scratch / name / flag.strip("-") / Path(out[i]).name)
    if "--out" not in argv:
        raise SystemExit(f"stage {name}: no --out argument to redirect")
    return out


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(main, argv: list[str]) -> tuple[float, float]:
    """(wall s, process CPU s) of one call; its stdout swallowed, a nonzero exit raised."""
    w, c = time.perf_counter(), cpu_s()
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    if rc:
        raise SystemExit(f"{' '.join(argv[:6])} …: exit {rc}")
    return time.perf_counter() - w, cpu_s() - c


def bundle_digests(out_dir: Path) -> dict[str, str]:
    """sha256 of every bundle file (``main.mlirb``, ``.odix``) under ``out_dir``."""
    return {p.relative_to(out_dir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out_dir.rglob("*")) if p.name == "main.mlirb" or p.suffix == ".odix"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tree", type=Path)
    ap.add_argument("--rules", default=",".join(DEFAULT_RULES))
    ap.add_argument("--dag-json", type=Path, help="bench_dag.py's JSON for TREE (the DAG's per-rule seconds)")
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args(argv)
    tree = ns.tree.resolve()
    os.chdir(tree)
    sys.path.insert(0, str(tree))
    dag = json.loads(ns.dag_json.read_text())["rules_s"] if ns.dag_json else {}
    result: dict = {"tree": str(tree), "cpus": os.cpu_count(), "rules": {}}
    with tempfile.TemporaryDirectory(prefix="floor-") as tmp:
        scratch = Path(tmp)
        for rule in ns.rules.split(","):
            calls = stage_calls(tree, rule)
            name, main_fn, args = calls[0]
            first = timed(main_fn, redirected(args, scratch / "first", name))
            rows, mismatched = [], []
            for name, main_fn, args in calls:
                call = redirected(args, scratch, name)
                wall, cpu = timed(main_fn, call)
                rows.append({"stage": name, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2)})
                out = Path(call[call.index("--out") + 1])
                if out.is_dir() and bundle_digests(out) != bundle_digests(tree / args[args.index("--out") + 1]):
                    mismatched.append(name)
                print(f"{name:48s} {wall:6.2f} s wall {cpu:6.2f} s CPU", flush=True)
            total = sum(r["wall_s"] for r in rows)
            result["rules"][rule] = {"stages": len(rows), "first_call_wall_s": round(first[0], 2),
                                     "warm_wall_s": round(total, 1), "warm_cpu_s": round(sum(r["cpu_s"] for r in rows), 1),
                                     "dag_s": dag.get(rule), "bundles_differing_from_tree": mismatched, "calls": rows}
            print(f"== {rule}: {len(rows)} stages, warm {total:.1f} s (first call {first[0]:.1f} s); "
                  f"in the DAG {dag.get(rule, '?')} s; bundles differing from the tree: {mismatched or 'none'}", flush=True)
    result["warm_wall_s"] = round(sum(r["warm_wall_s"] for r in result["rules"].values()), 1)
    print(f"floor of {', '.join(result['rules'])}: {result['warm_wall_s']} s"
          + (f" (the DAG: {sum(dag.get(r, 0) for r in result['rules']):.0f} s)" if dag else ""))
    if ns.json:
        ns.json.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if any(r["bundles_differing_from_tree"] for r in result["rules"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
