"""``make mutate``: mutation testing of the code that decides pass or fail (issue 34), with mutmut.

Each target below is a module (or some functions of one) and the FAST tests that judge it (no
built tree). For each, a copy of the working tree (tracked and new files, not ignored ones) gets a
``setup.cfg [mutmut]`` naming the module and the tests; ``mutmut run --max-children 1`` breaks the
code on purpose, one mutant at a time, and runs the tests that reach the mutated function. A
mutant the tests do not notice *survived*; a survivor whose change cannot alter any result is
*equivalent* (:data:`EQUIVALENT`: recognised by what the mutant changed, so the rules hold when the
module's mutants are renumbered) and is left out of the score:

    score = killed / (killed + survived - equivalent)        (timeouts count as killed)

Mutants of functions no selected test reaches ("no tests") are counted apart. The report lists
every survivor with its diff, equivalent or not. Exit 1 when a target's score is below its goal.

mutmut is not in requirements-test.txt (it pulls textual, libcst, rich, ...): it is installed
once with pip into ``--mutmut-dir`` (``pip install --target``; the packages the venv already has
are removed from there, so the venv's pytest runs the tests). CPU heavy: one target at a time,
one worker; a target's copy stays in ``--workdir`` for ``mutmut show`` / ``mutmut browse``.

    python scripts/mutate.py [--target gate_verdict ...] [--report bench/out/mutate.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTMUT = "mutmut==3.8.1"
GOAL = 0.90


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    module: str                 # the file mutmut mutates
    tests: tuple[str, ...]      # pytest files or node ids: fast, no built tree
    functions: tuple[str, ...] = ()  # only these functions' mutants (empty: every function of the module)

    @property
    def dotted(self) -> str:
        return self.module.removesuffix(".py").replace("/", ".")

    def patterns(self) -> list[str]:
        return [f"{self.dotted}.x_{f}__mutmut_*" for f in self.functions]


GATE_WORKERS_FAST = tuple(f"tests/test_gate_workers.py::{t}" for t in (
    "test_one_shard_covers_every_step_once_and_its_pieces_start_at_a_prompt",
    "test_a_stream_with_fewer_steps_than_the_gates_share_is_refused",
    "test_fewer_steps_keep_a_long_prompts_tokens_where_the_reference_recorded_them"))

TARGETS = (
    Target("gate_verdict", "recurrent_coreai/stages/gate_verdict.py",
           ("tests/test_gate_verdict.py", "tests/test_gate_counted.py", "tests/test_gate_verdict_edges.py",
            "tests/test_gate_text.py")),
    # the gate's thresholds as gate.py applies them: the epsilon in use, the reference's scale, the steps
    Target("gate_thresholds", "recurrent_coreai/stages/gate.py",
           ("tests/test_gate_counted.py", "tests/test_gate_verdict.py", "tests/test_gate_thresholds_edges.py",
            *GATE_WORKERS_FAST),
           ("checked_logit_scale", "with_epsilon", "gate_steps", "steps_fields", "next_token", "prompt_lengths")),
    # the shard plan the gather reads shards by (pipeline/shards.py)
    Target("shard_plan", "recurrent_coreai/pipeline/shards.py",
           ("tests/test_gate_shards.py::test_every_step_is_in_exactly_one_shard_and_the_prefill_check_in_one",
            "tests/test_gate_shards.py::test_one_shard_is_the_unsharded_gate_in_its_order",
            "tests/test_gate_shards.py::test_a_prompt_is_cut_only_where_it_shortens_the_longest_shard",
            "tests/test_gate_shard_args.py", "tests/test_gate_text.py", "tests/test_gate_thresholds_edges.py"),
           ("plan",)),
    # the staging re-derivation: the vocab tables, the gate TSV's rows and the comparison of records
    Target("derivation", "recurrent_coreai/stages/derivation.py",
           ("tests/test_vocab_derived.py",), ("check_vocab", "disagrees", "cmd_args")),
    Target("vocab_fit", "recurrent_coreai/tokenizers/fit.py",
           ("tests/test_vocab_fits_model.py", "tests/test_synthetic_vocab_sizes.py")),
)

def _each_replaced(text: str, old: str, new: str) -> set[str]:
    """``text`` with one occurrence of ``old`` replaced by ``new``, for each occurrence (a mutant
    changes one)."""
    at = [m.start() for m in re.finditer(re.escape(old), text)]
    return {text[:i] + new + text[i + len(old):] for i in at}


# Survivors whose change cannot alter a result: (why, test on the removed and the added line).
FLOAT_WORD = re.compile(r'float\("(nan|inf)"\)', re.IGNORECASE)
ERRSTATE = re.compile(r"np\.errstate\([^)]*\)")
EQUIVALENT = (
    ("float() reads 'nan' and 'inf' in any case",
     lambda old, new: old != new and old.lower() == new.lower() and FLOAT_WORD.search(old) is not None),
    ("np.errstate only silences RuntimeWarnings: every value is the same",
     lambda old, new: ERRSTATE.search(old) is not None and ERRSTATE.sub("E", old) == ERRSTATE.sub("E", new)),
    ("float64 is numpy's default float: np.array of Python floats, astype(None) give it",
     lambda old, new: new in _each_replaced(old, "np.float64", "None") | _each_replaced(old, ", np.float64)", ", )")),
    ("the first two of argsort's reversed tail are the top 2 for any vocabulary of 4 or more ids",
     lambda old, new: "[-2:][::-1]" in old and new in (old.replace("[-2:]", "[-3:]"), old.replace("[-2:]", "[+2:]"))),
    ("the prompts' token counts are read through int(): a float zero is the same count",
     lambda old, new: "np.zeros(n_prompts, np.int64)" in old
     and new in (old.replace("np.int64", "None"), old.replace(", np.int64)", ", )"))),
    ("gate.gate_steps raises the steps to the prompts' needs (gate_step_count), so prompt_budgets never refuses "
     "there: the arguments naming the setting in its refusal are never read",
     lambda old, new: old.startswith(("def gate_steps(", 'setting: str = "gate.steps")'))
     or "prompt_budgets([int(n) for n in counts], used, config_file, setting)" in old),
    ("a temporary directory's name is never read",
     lambda old, new: "TemporaryDirectory(prefix=" in old or 'fresh_dir = Path(tmp) / "vocab"' in old),
    ("the option key starts unset: None and '' are both false",
     lambda old, new: old == "key = None" and new == 'key = ""'),
    ("a piece without start and stop (the prefill or text check) is never split: 0, 1 or -1 are all below 2",
     lambda old, new: 's[0].get("stop", 0) - s[0].get("start", 0) >= 2' in old
     and new in (old.replace('get("stop", 0)', 'get("stop", 1)'), old.replace('get("start", 0)', 'get("start", 1)'))),
    ("max() of an array holding NaN is NaN: the NaN branch gives what it would",
     lambda old, new: "float(\"nan\") if np.isnan(d).any() else float(d.max())" in old
     and new == old.replace("if np.isnan(d).any()", "if (np.isnan(d).any()) and False")),
)


def equivalent(old: str, new: str) -> str | None:
    """Why the one-line change ``old`` -> ``new`` cannot alter a result, or None."""
    old, new = old.strip(), new.strip()
    return next((why for why, test in EQUIVALENT if test(old, new)), None)


# --- mutmut, installed beside the venv -----------------------------------------------------------
def mutmut_lib(where: Path) -> Path:
    """A pip --target directory holding mutmut and what the venv lacks of its dependencies."""
    stamp = where / f".{MUTMUT}"
    if stamp.is_file():
        return where
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(where), MUTMUT], check=True)
    for entry in sorted(where.iterdir()):  # the venv's own packages win (its pytest runs the tests)
        name = entry.name.removesuffix(".py")
        if entry.name.endswith((".dist-info", ".pth")) or name in ("bin", "__pycache__"):
            continue
        if importlib.util.find_spec(name) is not None:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    stamp.touch()
    return where


def copy_tree(dest: Path, head: bool = False) -> None:
    """The working tree's tracked and new (not ignored) files; ``head``: the last commit's files."""
    if dest.exists():
        shutil.rmtree(dest)
    if head:
        dest.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def setup_cfg(target: Target, copy: Path) -> str:
    top = sorted(p.name for p in copy.iterdir() if p.name not in ("recurrent_coreai", "tests", "pyproject.toml"))
    lines = ["[mutmut]", "source_paths=recurrent_coreai", f"only_mutate={target.module}", "also_copy="]
    lines += [f"    {name}" for name in top]
    lines += ["pytest_add_cli_args_test_selection="] + [f"    {t}" for t in target.tests]
    lines += ["pytest_add_cli_args=", "    -p no:cacheprovider", "    -q", ""]
    return "\n".join(lines)


def mutmut(args: list[str], copy: Path, lib: Path, **kw) -> subprocess.CompletedProcess:
    # mutmut forks each mutant's run from a process that has imported torch: with an OpenMP pool there
    # the child deadlocks in its first parallel torch op (futex wait, no CPU: what looked like mutmut's
    # CPU limit on tokenizers/fit.py, whose tests build synthetic checkpoints). One thread: no pool.
    env = dict(os.environ, PYTHONPATH=str(lib), PYTEST_WORKERS="0", RECURRENT_COREAI_PROGRESS="0",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=copy, env=env, text=True, **kw)


def diff_lines(text: str) -> tuple[str, str]:
    """(removed, added) lines of ``mutmut show``'s diff (one line each for mutmut's mutants)."""
    body = [line for line in text.splitlines() if line[:1] in "-+" and not line.startswith(("---", "+++"))]
    old = "\n".join(line[1:] for line in body if line.startswith("-"))
    new = "\n".join(line[1:] for line in body if line.startswith("+"))
    return old, new


def run_target(target: Target, workdir: Path, lib: Path, head: bool = False) -> dict:
    copy = workdir / target.name
    copy_tree(copy, head)
    (copy / "setup.cfg").write_text(setup_cfg(target, copy))
    t0 = time.perf_counter()
    mutmut(["run", "--max-children", "1", *target.patterns()], copy, lib, stdout=subprocess.DEVNULL,
           stderr=subprocess.PIPE, check=True)
    seconds = time.perf_counter() - t0
    listed = mutmut(["results", "--all", "true"], copy, lib, capture_output=True, check=True).stdout
    status = {}
    for line in listed.splitlines():
        name, _, state = line.strip().rpartition(": ")
        if name.startswith(target.dotted + "."):
            status[name] = state
    if target.functions:
        wanted = tuple(f".x_{f}__mutmut_" for f in target.functions)
        status = {n: s for n, s in status.items() if any(w in n for w in wanted)}
    survivors = []
    for name in sorted(n for n, s in status.items() if s == "survived"):
        old, new = diff_lines(mutmut(["show", name], copy, lib, capture_output=True, check=True).stdout)
        survivors.append({"name": name.rsplit(".", 1)[1], "old": old.strip(), "new": new.strip(),
                          "equivalent": equivalent(old, new)})
    count = {s: sum(v == s for v in status.values()) for s in sorted(set(status.values()))}
    killed = count.get("killed", 0) + count.get("timeout", 0)
    live = sum(1 for s in survivors if not s["equivalent"])
    return {"target": target, "seconds": seconds, "count": count, "total": len(status), "killed": killed,
            "equivalent": len(survivors) - live, "live": live, "survivors": survivors,
            "score": killed / (killed + live) if killed + live else 1.0}


def report(results: list[dict], commit: str) -> str:
    out = [f"# make mutate (mutmut 3.8.1, {commit})", "",
           "| target | module (functions) | mutants | killed | survived: equivalent | survived: live | no tests "
           "| score | goal | seconds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t = r["target"]
        where = t.module + (f" ({', '.join(t.functions)})" if t.functions else "")
        out.append(f"| {t.name} | {where} | {r['total']} | {r['killed']} | {r['equivalent']} | {r['live']} | "
                   f"{r['count'].get('no tests', 0)} | {r['score']:.1%} | {GOAL:.0%} | {r['seconds']:.0f} |")
    for r in results:
        if not r["survivors"]:
            continue
        out += ["", f"## {r['target'].name}: survivors", ""]
        for s in r["survivors"]:
            verdict = f"equivalent: {s['equivalent']}" if s["equivalent"] else "LIVE"
            out.append(f"- `{s['name']}` ({verdict}): `{s['old']}` -> `{s['new']}`")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/mutate.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="append", choices=[t.name for t in TARGETS],
                    help="a target to run (repeatable; default: all, in order)")
    ap.add_argument("--workdir", type=Path, default=ROOT / "bench" / "out" / "mutate")
    ap.add_argument("--mutmut-dir", type=Path, default=Path.home() / ".cache" / "recurrent-coreai" / MUTMUT)
    ap.add_argument("--report", type=Path, default=ROOT / "bench" / "out" / "mutate.md")
    ap.add_argument("--head", action="store_true", help="mutate the last commit's files, not the working tree's")
    ns = ap.parse_args(argv)
    lib = mutmut_lib(ns.mutmut_dir)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = (f"commit {commit.strip()}" if ns.head
              else f"working tree at {commit.strip()}{' + uncommitted edits' if dirty else ''}")
    results = []
    for target in (t for t in TARGETS if not ns.target or t.name in ns.target):
        print(f"mutate {target.name}: {target.module} ...", file=sys.stderr, flush=True)
        results.append(run_target(target, ns.workdir, lib, ns.head))
        r = results[-1]
        print(f"mutate {target.name}: {r['killed']}/{r['killed'] + r['live']} non-equivalent mutants killed "
              f"({r['score']:.1%}); {r['equivalent']} equivalent; {r['count'].get('no tests', 0)} without a test; "
              f"{r['seconds']:.0f} s", file=sys.stderr, flush=True)
        text = report(results, commit)  # after each target: a long run stopped early keeps what it measured
        ns.report.parent.mkdir(parents=True, exist_ok=True)
        ns.report.write_text(text)
    print(text)
    return 0 if all(r["score"] >= GOAL for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
